"""Mark every TIR kernel `tirx.noalias` before LLVM code generation (CPU).

TVM 0.27's LLVM code generator lets one kernel without `tirx.noalias` in a module weaken the
alias information of all the others: the KV cache's hand-written kernels and the VM's
shape functions lack the attribute, and with them in the same library LLVM had to assume
that the register tile of the tiled matmul (`schedules/cpu/tiled.py`) might alias its
inputs. It then stored the 12 partial sums and reloaded the inputs on every step: the same
kernel ran 2.7x slower in the model's library than built alone (40 ms vs 15 ms for a
500-token gate/up projection of SmolLM2).

The attribute promises that a kernel's buffer parameters never overlap. That holds here:
those kernels take distinct arrays (attention: queries, pages, page tables, outputs; page
copies and shape functions: a single array).
"""

from __future__ import annotations


def mark_noalias():
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="tallow.MarkNoAlias")
    def _pass(mod, _ctx):
        updated = {
            gv: func.with_attr("tirx.noalias", True)
            for gv, func in mod.functions_items()
            if isinstance(func, tvm.tirx.PrimFunc)
            and not (func.attrs and func.attrs.get("tirx.noalias"))
        }
        for gv, func in updated.items():
            mod[gv] = func
        return mod

    return _pass
