"""The integer widths of the kernels' arithmetic, read from Numba's typed IR (run by test_index_width.py).

Run as a script in a process with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0); prints one JSON object.
Each kernel is typed by numba-cuda's own passes, the untyped and typed pipelines a launch compiles with,
stopped before lowering (typing needs no GPU and takes seconds; lowering and NVVM would take minutes). For
every integer-valued operation of the typed IR (binary, in-place and unary operators, with the device
functions inlined as the kernels inline them) it records the result type, and every call that converts to
an integer type narrower than 64 bits (`int32(x)`, `np.int32(x)`), each with its source line.

Numba types an operation on integers narrower than 64 bits as a 64-bit one (its integer typing rule: the
result is at least intp wide), so a kernel can only compute in 32 bits through such a conversion. The
`--probes` mode types two small kernels whose answers are known, so a checker that sees nothing fails.

    python tests/index_width.py --probes
    python tests/index_width.py '[{"variant": "v2", "block_q": 64, ...}, ...]'
"""

import json
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

import fa_numba  # noqa: E402,F401  (binds numba to the real CUDA target before numba.cuda is imported)
from numba import cuda, int32, types  # noqa: E402
from numba.cuda import compiler, utils  # noqa: E402
from numba.cuda.core import ir  # noqa: E402
from numba.cuda.descriptor import cuda_target  # noqa: E402

OPERATORS = ("binop", "inplace_binop", "unary")


class _TypeOnly(compiler.CompilerBase):
    """numba-cuda's CUDACompiler pipeline without its lowering passes: bytecode to typed IR."""

    def define_pipelines(self):
        passes = compiler.PassManager("cuda_typing")
        for implementation, description in compiler.DefaultPassBuilder.define_untyped_pipeline(self.state).passes:
            if implementation is compiler.TranslateByteCode:
                implementation = compiler.CUDATranslateBytecode
            passes.passes.append((implementation, description))
        passes.passes.extend(compiler.DefaultPassBuilder.define_typed_pipeline(self.state).passes)
        passes.finalize()
        return [passes]

    def _compile_core(self):  # run the one pipeline; there is no compile result to wait for
        from numba.cuda.core.targetconfig import ConfigStack

        with ConfigStack().enter(self.state.flags.copy()):
            self.define_pipelines()[0].run(self.state)
        return self.state


def typed_ir(pyfunc, argtypes):
    """(func_ir, typemap, calltypes) of a kernel, typed as compile_cuda types it (cc 9.0, error model numpy)."""
    flags = compiler.CUDAFlags()
    flags.no_compile = flags.no_cpython_wrapper = flags.no_cfunc_wrapper = True
    flags.inline, flags.error_model, flags.compute_capability = "never", "numpy", (9, 0)
    with utils.numba_target_override():
        pipeline = _TypeOnly(cuda_target.typing_context, cuda_target.target_context, None, argtypes, types.void,
                             flags, {}, compiler.CUDACallConv(cuda_target.target_context), {})
        state = pipeline.compile_extra(pyfunc)
    return state.func_ir, state.typemap


def widths(pyfunc, argtypes) -> dict:
    """What the typed IR of one kernel computes its integers in (see the module docstring)."""
    func_ir, typemap = typed_ir(pyfunc, argtypes)
    found = {"operations": {}, "narrow_operations": [], "narrowing_conversions": [], "unsigned_conversions": 0}
    for block in func_ir.blocks.values():
        for statement in block.body:
            if not (isinstance(statement, ir.Assign) and isinstance(statement.value, ir.Expr)):
                continue
            expr, result = statement.value, typemap[statement.target.name]
            where = f"{statement.loc.filename.rsplit('/', 1)[-1]}:{statement.loc.line}"
            if expr.op in OPERATORS and isinstance(result, types.Integer):
                found["operations"][str(result)] = found["operations"].get(str(result), 0) + 1
                if result.bitwidth < 64:
                    found["narrow_operations"].append(f"{where} {expr} -> {result}")
            elif expr.op == "call" and isinstance(typemap.get(expr.func.name), types.NumberClass):
                target = typemap[expr.func.name].instance_type
                if isinstance(target, types.Integer) and target.bitwidth < 64:
                    found["narrowing_conversions"].append(f"{where} {expr} -> {target}")
                elif isinstance(target, types.Integer) and not target.signed:
                    found["unsigned_conversions"] += 1
    return found


# -- probes with known answers ---------------------------------------------------------------------------

def probe_wide(x):
    """Indexes in the hardware registers' int32, combined: Numba computes the sum and product in int64."""
    x[cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x] = 0.0


def probe_narrowing(x):
    """The same index, converted to int32 on purpose: one narrowing conversion."""
    x[int32(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)] = 0.0


def probes() -> dict:
    floats = (types.Array(types.float32, 1, "C"),)
    return {"wide": widths(probe_wide, floats), "narrowing": widths(probe_narrowing, floats)}


def kernels(configs: list[dict]) -> dict:
    from fa_numba import profile
    from fa_numba.kernels import backward

    out = {}
    for cfg in configs:  # a profile configuration, or {"kind": "preprocess" or "zero", ...} of the backward
        built = (backward.make(cfg["kind"], cfg["block_q"], cfg["head_dim"], False, cfg.get("flag", False))
                 if "kind" in cfg else profile._build(cfg))
        argtypes = built.argtypes(cfg["dtype"])
        if cfg.get("strided"):  # q, k, v as strided views (layout "A"), as api._prepare passes them
            argtypes = profile._strided(argtypes, 3)
        out[json.dumps(cfg, sort_keys=True)] = widths(built.source, argtypes)
    return out


def main(argv) -> int:
    print(json.dumps(probes() if argv == ["--probes"] else kernels(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
