"""The one rule for edits (patch, sweep, graft) of a joint forward+backward graph.

A joint program's outputs are the loss and the parameters' gradients; its backward nodes were derived from the
forward as it was exported. An edit is exact (the graph's outputs are eager autograd's for the edited model)
where that derivation still holds, and refused by name where it does not:

- a *forward activation computed from parameters whose gradients are outputs* is refused for every edit: the
  backward runs the chain rule through the edited value with the original op's derivative, which is neither eager's
  under a forward hook (that cuts or replaces the path) nor the unedited gradients;
- a *graft after such a parameter* is refused too (eager differentiates through the block, a parametrization; the
  graph gives the gradient with respect to the block's output); a patch of a parameter is a new weight, exact;
- a forward value with no such parameter before it (an input, a function of inputs only) is a patch site as an
  input is, and so is a graft there in the node form (every reader, the backward's included, reads the block's
  output: a patch by the block's value). The edge form reroutes one reader only: exact while no backward node
  reads the value (its readers' backward would read the unedited one), refused otherwise;
- a gradient node (anything that is not the loss or one of its ancestors) is differentiated by nothing in the
  graph: every edit there is the graph's dataflow under that edit, as eager's tensor hook on that gradient is.

Which outputs are the loss and the gradients is the export signature's (the IR's output node does not carry it),
so the rule lives here, at the level that holds both the graph and that signature; ReactiveGraph applies it to
patch, sweep and graft, and to its ``engine`` view. ``ReactiveGraph.dataflow_edits()`` turns it off, by name, for
cost measurements that count cones of forward edits (the gradient outputs are then the graph's dataflow, not
gradients of anything).
"""
from __future__ import annotations

from typing import Callable


class JointEditRule:
    """The rule for one graph revision: ``nodes`` (name -> IR node), ``inputs_of`` (an IR node -> the names it
    reads), the output index of the loss and the parameter targets whose gradients are outputs."""

    def __init__(self, nodes: dict, inputs_of: Callable, loss_output: int, with_grad: set):
        self._nodes, self._inputs_of = nodes, inputs_of
        out = next(n for n in nodes.values() if n.kind == "output")
        forward, stack = set(), [inputs_of(out)[loss_output]]
        while stack:  # the loss and its ancestors: the forward pass
            n = stack.pop()
            if n not in forward:
                forward.add(n)
                stack.extend(inputs_of(nodes[n]))
        self._forward = forward
        self._params = {n.name: n.state_name for n in nodes.values()
                        if n.kind == "placeholder" and n.state_name in with_grad}
        self._readers: dict | None = None

    def _parameters_before(self, node: str) -> list[str]:
        """The parameters with gradient outputs among ``node`` and its ancestors, sorted."""
        seen, stack, found = set(), [node], []
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self._params:
                found.append(self._params[n])
            stack.extend(self._inputs_of(self._nodes[n]))
        return sorted(found)

    def _backward_readers(self, node: str) -> list[str]:
        if self._readers is None:
            readers: dict = {}
            for n in self._nodes.values():
                for a in self._inputs_of(n):
                    readers.setdefault(a, []).append(n.name)
            self._readers = readers
        return [r for r in self._readers.get(node, []) if r not in self._forward and self._nodes[r].kind != "output"]

    def refusal(self, node: str, what: str, graft: bool = False, dst: str = "") -> str | None:
        """Why an edit of ``node`` (``what``: "patch", "sweep", "graft after") is refused, or None where it is
        exact. ``graft``: the edit is a graft after ``node``, on the edge to ``dst`` (empty: every reader)."""
        if node not in self._forward:
            return None  # a gradient node: nothing in the graph differentiates it
        head = f"{what} {node!r}: this graph is a joint forward+backward program and {node!r}"
        if node in self._params:
            if not graft:
                return None  # a new weight: the backward computes its gradient at that weight
            return (f"{head} is the parameter {self._params[node]} whose gradient is an output; eager differentiates "
                    "through the block (a parametrization), while the graph would give the gradient with respect to "
                    "the block's output. Put the block into the model (torch.nn.utils.parametrize) and export the "
                    "joint program again, or patch the parameter with the block's value")
        found = self._parameters_before(node)
        if found:
            names = ", ".join(found[:4]) + (f", ... ({len(found)} in all)" if len(found) > 4 else "")
            edit = "block" if graft else "patch"
            return (f"{head} is a forward activation computed from parameters ({names}) whose gradients are outputs; "
                    f"its backward was derived without the {edit}, so their gradients would run the chain rule through "
                    f"the {'grafted' if graft else 'patched'} value with the original op's derivative, neither eager's "
                    f"under a forward hook nor the unedited ones. {'Graft on' if graft else 'Patch'} a gradient node, or "
                    f"{'graft on' if graft else 'patch'} activations on a graph of the model in eval mode "
                    "(ReactiveGraph(model, inputs))"
                    + (", or put the block into the model and export the joint program again" if graft else ""))
        if graft and dst:
            readers = self._backward_readers(node)
            if readers:
                shown = ", ".join(repr(r) for r in readers[:4]) + (" ..." if len(readers) > 4 else "")
                return (f"{head} is read by the backward ({shown}) as well as by the forward; the edge to {dst!r} "
                        "would give the block's value to one and the unedited value to the other, so the gradients "
                        f"would be those of neither model. Graft in the node form (graft({node!r}, block): every "
                        "reader, the backward's included, reads the block's output, as after a patch)")
        return None
