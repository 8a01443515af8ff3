"""One gated MLP's forward, an expert's or a dense slice's: act(gate x) * up x, then down.

`GatedExpert` runs it as one stored-format kernel call (layer_cpu.cpp's df_gated_mlp) where the
activation and weights allow, for one expert or for every slice of a dense layer at once (`slices`),
else as three matmuls; `swiglu` builds one from config.json's `hidden_act`. moe.py dispatches to it.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from deltafind.models.ops import fast_math
from deltafind.models.ops.cpu_kernels import CPU, MoeExpert
from deltafind.models.ops.norm import RMSNorm
from deltafind.models.ops.stored import FusedLinear, linear
from deltafind.provider import Expert

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        from deltafind.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        ) from None


def expert_forward(
    x: torch.Tensor, expert: Expert, gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """A gated-MLP expert (or dense slice): down(gated(gate x, up x)). x [n, H] -> [n, H].

    Weights are computed on in their stored format (models/ops/stored.py)."""
    q = expert.quant
    gate = linear(x, expert["gate_proj"], quant=q.get("gate_proj", ""))
    up = linear(x, expert["up_proj"], quant=q.get("up_proj", ""))
    return linear(gated(gate, up), expert["down_proj"], quant=q.get("down_proj", ""))


# The activations df_gated_mlp computes itself (layer_cpu.cpp's `act` codes), by config.json name.
KERNEL_ACTS = {"silu": 0, "swish": 0, "gelu": 1, "gelu_pytorch_tanh": 2}


class SlicesPlan:
    """The stored-format kernel's parts for a list of slices (or one expert): every gate then every up
    stacked, the downs side by side. Planned again when any slice object changes; holds them weakly."""

    def __init__(self) -> None:
        self.gate_up, self.down = FusedLinear(), FusedLinear(stack_cols=True)
        self._refs: tuple[weakref.ref, ...] = ()
        # A routed expert's parts as df_moe_token takes them, its address, and the (in, out) columns, as
        # planned: a decode token's experts make one call with them (GatedExpert.adder)
        self.moe = MoeExpert()
        self.moe_at = ctypes.addressof(self.moe)
        self.shape = (0, 0)

    def plan(self, experts: Sequence[Expert]) -> bool:
        """Whether the kernel takes these slices (their parts are then planned)."""
        if len(self._refs) == len(experts) and all(
            r() is e for r, e in zip(self._refs, experts, strict=True)
        ):
            return True
        self._refs = ()
        names = ("gate_proj", "up_proj")
        gu = self.gate_up.parts(
            [e[n] for n in names for e in experts],
            [e.quant.get(n, "") for n in names for e in experts],
        )
        dn = self.down.parts(
            [e["down_proj"] for e in experts], [e.quant.get("down_proj", "") for e in experts]
        )
        if gu is None or dn is None or 2 * self.down.in_cols != self.gate_up.out_cols:
            return False
        self._refs = tuple(weakref.ref(e) for e in experts)
        self.moe.gu, self.moe.down, self.moe.n_gu, self.moe.n_down = (
            ctypes.addressof(gu),
            ctypes.addressof(dn),
            len(gu),
            len(dn),
        )
        self.shape = (self.gate_up.in_cols, self.down.out_cols)
        return True


class GatedExpert:
    """A gated-MLP expert's forward, `expert_forward` with one `gated(gate, up)`: callable per expert
    (dispatch's `run`), and `slices` runs a dense layer's slices with ONE gate/up and ONE down matmul.
    Where `act` names an activation the kernel computes (KERNEL_ACTS), gate/up, activation and down
    run as ONE kernel call (layer_cpu.cpp's df_gated_mlp), with the layer's norm and residual."""

    def __init__(
        self, gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], act: str = ""
    ) -> None:
        self.gated, self.act = gated, KERNEL_ACTS.get(act, -1)
        self._slices = SlicesPlan()  # a dense layer's slices
        self._plans: dict[
            int, tuple[weakref.ref, SlicesPlan | None]
        ] = {}  # routed experts' plans, by id while alive
        self._norm_fits: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, expert: Expert) -> torch.Tensor:
        if (plan := self._plan_of(expert)) is not None and (
            y := self._run(x, plan, None)
        ) is not None:
            return y
        return expert_forward(x, expert, self.gated)

    def adder(
        self, x: torch.Tensor, out: torch.Tensor
    ) -> Callable[[Sequence[Expert], Sequence[float]], bool] | None:
        """`add(experts, ws)`: out += self(x, e) * w for each expert e and its weight w in the order given,
        in ONE df_moe_token call, for one token x [1, H] and out [1, H] fp32, contiguous, on the CPU; False
        where the kernel does not take one of them (out is then untouched: run them through `__call__`).
        None where it takes no expert here. The products and sums round as torch's fp32 `out += y * w` does
        (layer_cpu.cpp), so moe.py's one-token sum is the same numbers without two torch ops an expert,
        and a decode token's held experts make one call, not one each (tests/bench/RESULTS.md)."""
        if (
            self.act < 0
            or (lib := CPU.load()) is None
            or x.dtype != torch.float32
            or out.dtype != torch.float32
            or not (x.is_cpu and out.is_cpu and x.is_contiguous() and out.is_contiguous())
            or x.shape != (1, cols := x.shape[-1])
            or out.shape != x.shape
            or fast_math.takes(x)
        ):
            return None
        call, plan_of, act, xp, yp, threads = (
            lib.df_moe_token,
            self._plan_of,
            self.act,
            x.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        shape = (cols, cols)

        def add(experts: Sequence[Expert], ws: Sequence[float]) -> bool:
            at = []
            for expert in experts:
                if (plan := plan_of(expert)) is None or plan.shape != shape:
                    return False
                at.append(plan.moe_at)
            k = len(at)
            # the weights as fp32 are exact: moe.py takes this path only for fp32 routing weights
            return not call(
                (ctypes.c_void_p * k)(*at), k, (ctypes.c_float * k)(*ws), xp, act, yp, threads
            )

        return add

    def _plan_of(self, expert: Expert) -> SlicesPlan | None:
        """The kernel's plan for one routed expert (None: the kernel does not take it), made once while
        the expert object lives: planned again on every call, as one plan for the last expert was, it
        cost ~24 us a call, a tenth of a 2048 x 768 bf16 expert's kernel call at 1 thread (RESULTS.md)."""
        key = id(expert)
        if (held := self._plans.get(key)) is not None and held[0]() is expert:
            return held[1]
        plan: SlicesPlan | None = SlicesPlan()
        if not plan.plan([expert]):
            plan = None
        plans = self._plans  # the entry goes with the expert (before its id can be reused)
        plans[key] = (weakref.ref(expert, lambda _, key=key: plans.pop(key, None)), plan)
        return plan

    def slices(
        self, x: torch.Tensor, experts: Sequence[Expert], norm: RMSNorm | None = None
    ) -> torch.Tensor | None:
        """sum_s down_s(gated(gate_s n, up_s n)) for x [T, H] and n = x, or with `norm` the decoder
        layer's MLP half x + that for n = norm(x), the slices' matrices where they are; None where the
        stored-format kernel does not apply."""
        return self._run(x, self._slices, norm) if self._slices.plan(experts) else None

    def held_parts(
        self, slices: Sequence[Expert], norm: RMSNorm, cols: int
    ) -> tuple[ctypes.Array, ctypes.Array] | None:
        """The planned gate/up and down parts with which `slices(x, slices, norm)` for x [1, cols] makes
        its one df_gated_mlp call (layer_cpu.cpp's df_decode_layers makes that call), else None."""
        w = norm._parameters["weight"]
        plan = self._slices
        if (
            self.act < 0
            or not plan.plan(slices)
            or plan.gate_up.in_cols != cols
            or plan.down.out_cols != cols
            or (w is not self._norm_fits and not _fits(w, cols))
        ):
            return None
        self._norm_fits = w
        return plan.gate_up.parts_planned, plan.down.parts_planned

    def _run(self, x: torch.Tensor, plan: SlicesPlan, norm: RMSNorm | None) -> torch.Tensor | None:
        if (
            x.dtype != torch.float32
            or not x.is_cpu
            or x.dim() != 2
            or (shape := x.shape)[1] != plan.gate_up.in_cols
            or not shape[0]
        ):
            return None
        x = x.contiguous()
        if (y := self._fused_call(x, plan, norm)) is not None:
            return y
        n = x if norm is None else norm(x)
        gu = plan.gate_up.run(n)  # [T, 2I]: gates, then ups
        if gu is None:
            return None
        half = gu.shape[1] // 2
        y = plan.down.run(self.gated(gu[:, :half], gu[:, half:]))  # [T, I], slice s at its columns
        return y if y is None or norm is None else x + y

    def _fused_call(
        self, x: torch.Tensor, plan: SlicesPlan, norm: RMSNorm | None
    ) -> torch.Tensor | None:
        """`_run` in one df_gated_mlp call, or None where the kernel lacks the activation or the norm's layout."""
        w = (
            None if norm is None else norm._parameters["weight"]
        )  # not norm.weight: nn.Module.__getattr__ costs ~1 us
        if (
            self.act < 0
            or fast_math.takes(x)  # bf16 prefill: the parts' matmuls take fast_math's kernel
            or (w is not None and w is not self._norm_fits and not _fits(w, x.shape[1]))
        ):
            return None
        self._norm_fits = w  # checked once per norm weight object
        gu, dn, y = (
            plan.gate_up.parts_planned,
            plan.down.parts_planned,
            torch.empty(x.shape[0], plan.down.out_cols),
        )
        if CPU.load().df_gated_mlp(
            gu,
            len(gu),
            dn,
            len(dn),
            x.data_ptr(),
            x.shape[0],
            self.act,
            None if w is None else w.data_ptr(),
            0.0 if norm is None else norm.eps,
            int(norm is not None),
            y.data_ptr(),
            torch.get_num_threads(),
        ):
            return None
        return y


def _fits(w: torch.Tensor, cols: int) -> bool:
    """Whether df_gated_mlp takes `w` as the RMSNorm weight of rows of `cols` (fp32 on the CPU, a multiple of 8)."""
    return (
        w.dtype == torch.float32
        and w.is_contiguous()
        and w.device.type == "cpu"
        and w.shape == (cols,)
        and not cols % 8
    )


def swiglu(hidden_act: str) -> GatedExpert:
    """One SwiGLU expert (or dense slice), act(gate x) * up x, with config.json's `hidden_act`."""
    act = activation(hidden_act)
    return GatedExpert(lambda gate, up: act(gate) * up, hidden_act)
