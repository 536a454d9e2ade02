"""Launch Triton kernels through their compiled binaries: the autotuner and the JIT dispatch run once per
specialization, not on every call.

Why: host time per launch of one kernel on an H200 (bench/bench_launch.py, triton 3.6): through the autotuner
~25 us, through the JIT with a fixed config ~17 us, the compiled binary ~9 us. A LayerNorm forward + backward is
three launches and an attention forward + backward three; with ~100 such launches per training step the Python
side must stay ahead of the GPU, and small problems (decoding, micro-benchmarks) are bound by it.

How: `fast(kernel)` wraps a `@triton.jit` function or a `@triton.autotune`d one and is called like it,
`fast_kernel[grid](*args, **constexprs)`. Each call computes a cheap key of what the JIT specialises on:
    tensors       dtype, and whether the address is 16-byte aligned
    descriptors   (host TMA descriptors of Gluon kernels) dtype, block shape and shared-memory layout
    ints          == 1, divisible by 16, fits in int32            (bools and None by value, floats by type)
    constexprs    by value; the autotuner's key arguments also by value (so a new T bucket is tuned anew)
    device        the current CUDA device (the JIT keeps one cache per device)
On a miss the kernel runs the normal way and the CompiledKernel it returns is kept with the chosen config; on a hit
the binary is launched directly: `compiled[grid](*args, *constexprs)`. The key is conservative: it may hold more
entries than the JIT's cache, never fewer, so a binary is only reused where the JIT would have picked the same one.
Non-constexpr arguments must be passed positionally.
Tuning (kernels/tuning.py): an autotuned kernel's first call per tuning key takes the stored choice if there is
one (only that config compiles), else announces the tuning, compiles the candidates on threads, lets the autotuner
time them and stores its pick. Under TRITON_INTERPRET=1 (CPU tests) no binary is kept: every call is a `launch`.
"""
import inspect
import os

import torch
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from kernels import tuning

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_I32 = 2 ** 31


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host ints. triton's is a constexpr_function: ~1.5 us a call from Python (triton 3.6), and a
    launcher's grid may call it several times a launch (notes/fp8.md, host overhead)."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """triton.next_power_of_2 for host ints (the same constexpr_function cost); 0 for n < 1, as triton's gives 0."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _spec(args) -> tuple:
    """What the JIT specialises a call on, per positional argument. Exact type checks first (ints and tensors are
    almost every argument): 6.7 vs 11.2 us for attention's 46 arguments with isinstance chains (CPU)."""
    key = []
    for a in args:
        t = type(a)
        if t is int:
            key.append((a == 1, a % 16 == 0, -_I32 <= a < _I32))
        elif t is bool or a is None:
            key.append(a)
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            key.append(a)
        elif isinstance(a, int):  # an int subclass
            key.append((a == 1, a % 16 == 0, -_I32 <= a < _I32))
        elif hasattr(a, "block_shape"):  # a host TMA descriptor: specialised on its dtype, block and layout
            key.append((a.base.dtype, tuple(a.block_shape), a.layout))
        else:
            key.append(t)
    return tuple(key)


class FastKernel:
    def __init__(self, kernel):
        self.kernel = kernel
        jit = kernel.fn if isinstance(kernel, Autotuner) else kernel
        self.names = jit.arg_names
        self.tuned_on = [self.names.index(k) for k in getattr(kernel, "keys", [])]  # autotune key positions
        self.tuner = tuning.Tuner.of(kernel) if isinstance(kernel, Autotuner) and len(kernel.configs) > 1 else None
        self.defaults = {n: p.default for n, p in inspect.signature(jit.fn).parameters.items()
                         if p.default is not inspect.Parameter.empty}  # constexprs a config may leave out
        self.cache = {}

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.run(grid, args, constexprs)

    def run(self, grid, args, constexprs):
        if _INTERPRET:  # no binary kept; the tail is still built, so CPU tests see what the GPU path would
            compiled = self.launch(grid, args, constexprs)
            self.tail(len(args), constexprs)
            return compiled
        key = (torch.cuda.current_device(), _spec(args), tuple(args[i] for i in self.tuned_on if i < len(args)),
               tuple(constexprs.items()))  # binaries are per device, as in the JIT's own cache
        hit = self.cache.get(key)
        if hit is None:  # tune / compile / launch the normal way, then keep the binary and its config
            compiled = self.launch(grid, args, constexprs)
            self.cache[key] = (compiled, *self.tail(len(args), constexprs))
            return compiled
        compiled, meta, tail = hit
        g = grid(meta) if callable(grid) else grid
        compiled[(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)](*args, *tail)
        return compiled

    def tail(self, n_args: int, constexprs):
        """The grid's meta (the call's constexprs, the chosen config's kwargs, the kernel's defaults for what
        neither gives) and the constexpr values a binary launch appends after the positional arguments."""
        cfg = getattr(self.kernel, "best_config", None)
        meta = {**self.defaults, **constexprs, **(cfg.kwargs if cfg is not None else {})}
        missing = [n for n in self.names[n_args:] if n not in meta]
        if missing:
            raise TypeError(f"{self.names}: pass non-constexpr arguments positionally (got {missing} by name)")
        return meta, tuple(meta[n] for n in self.names[n_args:])

    def launch(self, grid, args, constexprs):
        """The normal launch. For an autotuned kernel at a tuning key its autotuner has not seen, the stored choice
        goes into the autotuner's own cache, which then launches it as one it picked (the config's kwargs, num_warps,
        num_stages, num_ctas, maxnreg and pre_hook; no timing, so no reset_to_zero / restore_value); without one the
        tuning runs here and its pick is stored."""
        k = self.kernel
        if self.tuner is None:
            return k[grid](*args, **constexprs)
        key = autotune_key(k, args, constexprs)
        if key in k.cache:
            return k[grid](*args, **constexprs)
        stored = self.tuner.get(key)
        cfg = next((c for c in k.configs if tuning.config_record(c) == stored), None) if stored else None
        if cfg is not None:
            k.cache[key] = cfg
            return k[grid](*args, **constexprs)
        k.nargs = dict(zip(k.arg_names, args))
        try:
            candidates = k.prune_configs(constexprs)  # what the autotuner will time
        finally:
            k.nargs = None
        name = k.base_fn.__name__.strip("_").removesuffix("_kernel")
        shown = ", ".join(f"{n}={v}" for n, v in zip(k.keys, key))
        with self.tuner.tuning(f"{name} for {shown} ({len(candidates)} candidates)"):
            if not _INTERPRET and isinstance(k.fn, JITFunction):
                tuning.compile_parallel(k.fn, [(grid, args, {**constexprs, **c.all_kwargs()}) for c in candidates])
            compiled = k[grid](*args, **constexprs)
            self.tuner.put(key, tuning.config_record(k.cache[key]))
        return compiled


def autotune_key(autotuner, args, kwargs) -> tuple:
    """The key under which triton 3.6's Autotuner.run caches its pick: the values of its `key` arguments, then the
    dtype of every tensor argument (tests/test_launch.py checks this against a real tuning)."""
    named = {**dict(zip(autotuner.arg_names, args)), **kwargs}
    named = {n: v for n, v in named.items() if n in autotuner.arg_names}
    return tuple([named[n] for n in autotuner.keys if n in named] +
                 [str(v.dtype) for v in named.values() if hasattr(v, "dtype")])


def fast(kernel) -> FastKernel:
    return FastKernel(kernel)


def tma_scratch(size, alignment, stream):
    """Global memory for device-side TMA descriptors (`tl.make_tensor_descriptor`, 128 bytes each per program).
    Triton asks `triton.set_allocator` for it; that allocator is a ContextVar (per thread: the autograd engine runs
    the backward on its own thread), so launchers of such kernels set it on every call."""
    return torch.empty(size, dtype=torch.int8, device="cuda")
