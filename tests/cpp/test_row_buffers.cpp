// RowBufferPool (reactive/row_buffers.h): a storage is handed out again only once nothing references it.
#include "reactive/row_buffers.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using torch_ext::reactive::RowBufferPool;

namespace {
const at::TensorOptions kFloat = at::TensorOptions().dtype(at::kFloat);
}

TEST(ReactiveRowBuffers, AStorageAViewStillReadsIsNeverHandedOutAgain) {
  RowBufferPool pool;
  at::Tensor a = pool.take({64, 256}, kFloat);
  EXPECT_TRUE(a.is_contiguous());
  EXPECT_EQ(a.sizes(), at::IntArrayRef({64, 256}));
  a.fill_(1.0);
  at::Tensor view = a.narrow(0, 3, 2);  // what a later reader (a metric, restore) may still hold
  const void* first = a.data_ptr();
  a.reset();
  at::Tensor b = pool.take({64, 256}, kFloat);
  EXPECT_NE(b.data_ptr(), first);  // the view keeps the first storage out of the pool
  b.fill_(2.0);
  EXPECT_TRUE(at::all(view == 1.0).item<bool>());
  EXPECT_EQ(pool.reused(), 0);
  EXPECT_EQ(pool.allocated(), 2);
  view.reset();
  const void* second = b.data_ptr();
  b.reset();
  at::Tensor c = pool.take({32, 512}, kFloat);  // same bytes, another shape
  EXPECT_EQ(pool.reused(), 1);
  EXPECT_TRUE(c.data_ptr() == first || c.data_ptr() == second);
  EXPECT_EQ(c.sizes(), at::IntArrayRef({32, 512}));
}

TEST(ReactiveRowBuffers, ASmallValueDoesNotTakeALargeStorage) {
  RowBufferPool pool;
  pool.take({1024, 256}, kFloat).reset();  // 1 MiB, free again
  at::Tensor small = pool.take({64, 256}, kFloat);  // 64 KiB
  EXPECT_EQ(pool.reused(), 0);
  EXPECT_EQ(pool.allocated(), 2);
  at::Tensor large = pool.take({1000, 256}, kFloat);  // fits the free 1 MiB storage
  EXPECT_EQ(pool.reused(), 1);
  pool.clear();  // drops free storages only: the held ones stay valid
  large.fill_(3.0);
  small.fill_(4.0);
  EXPECT_TRUE(at::all(large == 3.0).item<bool>());
}
