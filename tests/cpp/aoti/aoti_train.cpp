// Runs an AOTInductor-compiled torch_ext pure training step with no Python.
//
//   aoti_train <step.pt2> <inputs.pt>
//
// inputs.pt is torch.save((state: list[Tensor], others: list[Tensor], batches: list[list[Tensor]])):
// the program takes [state..., others..., batch...] and returns [loss, new state...]. Each step's
// new state feeds the next call. Prints one loss per line.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <vector>

namespace {
std::vector<at::Tensor> tensors_of(const c10::IValue& v) {
  std::vector<at::Tensor> out;
  for (const auto& e : v.toListRef()) out.push_back(e.toTensor());
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <step.pt2> <inputs.pt>\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", argv[2]);
    return 2;
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::IValue data = torch::jit::pickle_load(bytes);
  const auto& parts = data.toTupleRef().elements();
  std::vector<at::Tensor> state = tensors_of(parts.at(0));
  const std::vector<at::Tensor> others = tensors_of(parts.at(1));
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  for (const auto& batch_value : parts.at(2).toListRef()) {
    std::vector<at::Tensor> inputs = state;
    inputs.insert(inputs.end(), others.begin(), others.end());
    for (const at::Tensor& t : tensors_of(batch_value)) inputs.push_back(t);
    std::vector<at::Tensor> outs = loader.run(inputs);
    if (outs.size() != state.size() + 1) {
      std::fprintf(stderr, "expected %zu outputs, got %zu\n", state.size() + 1, outs.size());
      return 1;
    }
    std::printf("%.9g\n", outs[0].item<double>());
    state.assign(outs.begin() + 1, outs.end());
  }
  return 0;
}
