#include "ir/users.h"

namespace torch_ext::ir {

std::vector<const Node*> transitive_users(const Node* root, const std::function<bool(const Node&)>& follow) {
  std::vector<const Node*> out, work{root};
  while (!work.empty()) {
    const Node* v = work.back();
    work.pop_back();
    for (const Node* u : v->users()) {
      if (u->kind() != NodeKind::Call) continue;
      out.push_back(u);
      if (follow(*u)) work.push_back(u);
    }
  }
  return out;
}

}  // namespace torch_ext::ir
