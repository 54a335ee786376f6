// Replays the fuzz corpus (tests/python/fuzz_corpus: the seeds and every saved finding) through
// parse -> verify -> Executor -> reactive Engine in C++, so scripts/sanitize.sh checks it under
// ASan and UBSan. Every step must either succeed or throw a c10::Error that is not an internal
// assert; anything else (another exception type, a crash) fails the test.
#include "ir/graph.h"
#include "ir/parser.h"
#include "ir/verifier.h"
#include "reactive/engine.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;
using namespace torch_ext;

namespace {

constexpr int64_t kMaxInputBytes = int64_t{1} << 24;  // graphs with bigger inputs are only verified

std::vector<fs::path> corpus_files() {
  // Set by CMakeLists.txt: the corpus is found wherever the binary runs from.
  const fs::path root = TORCH_EXT_FUZZ_CORPUS;
  std::vector<fs::path> out;
  for (const fs::path& dir : {root, root / "seeds"}) {
    if (!fs::is_directory(dir)) continue;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".ir") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Inputs for the placeholders, or nullopt when they are too big or not on the CPU.
std::optional<std::vector<c10::IValue>> make_inputs(const ir::Graph& g) {
  std::vector<c10::IValue> in;
  int64_t bytes = 0;
  for (const ir::Node* p : g.placeholders()) {
    const ir::Type& t = p->type();
    if (t.kind == ir::Type::Kind::Int) {
      in.emplace_back(int64_t{2});
    } else if (t.kind == ir::Type::Kind::Float) {
      in.emplace_back(0.5);
    } else if (t.kind == ir::Type::Kind::Bool) {
      in.emplace_back(false);
    } else if (t.is_tensor()) {
      if (t.tensor.device.type() != c10::kCPU) return std::nullopt;
      bytes += t.tensor.numel() * static_cast<int64_t>(c10::elementSize(t.tensor.dtype));
      if (bytes > kMaxInputBytes) return std::nullopt;
      auto opts = at::TensorOptions().dtype(t.tensor.dtype);
      at::Tensor x = at::isFloatingType(t.tensor.dtype) || at::isComplexType(t.tensor.dtype)
                         ? at::randn(t.tensor.sizes, opts)
                         : at::randint(0, t.tensor.dtype == at::kBool ? 2 : 4, t.tensor.sizes, opts);
      in.emplace_back(x);
    } else {
      in.emplace_back();
    }
  }
  return in;
}

// Runs `step`; a c10::Error is an acceptable refusal unless it is an internal assert.
bool step_ok(const std::string& file, const char* what, const std::function<void()>& step) {
  try {
    step();
    return true;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_EQ(msg.find("INTERNAL ASSERT FAILED"), std::string::npos) << file << ": " << what << ": " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << file << ": " << what << " threw a non-c10 exception: " << e.what();
  }
  return false;
}

}  // namespace

TEST(FuzzCorpus, ReplaysWithOnlyProjectErrors) {
  const auto files = corpus_files();
  ASSERT_FALSE(files.empty()) << "no fuzz corpus found in " << TORCH_EXT_FUZZ_CORPUS;
  at::manual_seed(0);
  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    const std::string name = f.filename().string();
    std::unique_ptr<ir::Graph> g;
    if (!step_ok(name, "parse", [&] { g = ir::parse(text); })) continue;
    if (!step_ok(name, "verify", [&] { ir::verify(*g); })) continue;
    std::unique_ptr<runtime::Executor> ex;
    if (!step_ok(name, "Executor", [&] { ex = std::make_unique<runtime::Executor>(*g); })) continue;
    auto inputs = make_inputs(*g);
    if (!inputs) continue;
    step_ok(name, "Executor::run", [&] { ex->run(*inputs); });
    std::unique_ptr<reactive::Engine> engine;
    if (!step_ok(name, "Engine", [&] { engine = std::make_unique<reactive::Engine>(*g); })) continue;
    step_ok(name, "Engine::run/demand", [&] {
      engine->run(*inputs);
      engine->demand();
    });
  }
}
