"""A Relax pass that puts a TE computation in place of one float32 operator.

The CPU's fast activations (`fast_silu_pass`, `fast_gelu_pass`) are each this pass with
their own formula: before legalization, every call of the operator on a float32 tensor
becomes a `call_te` of the formula (other dtypes keep TVM's lowering).
"""

from __future__ import annotations

from collections.abc import Callable


def replace_float32_op(op_name: str, compute: Callable, hint: str, pass_name: str):
    """The module pass replacing `op_name` (e.g. "relax.nn.silu") on float32 inputs by
    `compute(x: te.Tensor) -> te.Tensor`, its PrimFuncs named after `hint`."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    op = tvm.ir.Op.get(op_name)

    @mutator
    class _Rewriter(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            arg_type = getattr(call.args[0], "ty", None) if call.args else None
            if call.op.same_as(op) and str(getattr(arg_type, "dtype", "")) == "float32":
                return self.builder_.call_te(compute, call.args[0], primfunc_name_hint=hint)
            return call

    @tvm.transform.module_pass(opt_level=0, name=pass_name)
    def _pass(mod, _ctx):
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()

    return _pass
