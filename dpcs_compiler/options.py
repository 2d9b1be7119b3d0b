"""User options of the dpcs backend: one frozen dataclass, validated on construction.

`torch.compile(model, backend="dpcs", options={...})` hands the dict to `DpcsOptions.from_dict`; an unknown
key or a bad value raises a ValueError that names the key, the value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpcs_compiler.cost.hardware import HardwareProfile, profile_to_json
from dpcs_compiler.cost.op_time import Calibration
from dpcs_compiler.cost.profiles import MEASURE, ProfileSpec, parse_profile_spec, profile_choices
from dpcs_compiler.cost.step_model import StepContext

COMPILERS = ("inductor", "eager")
ON_INFEASIBLE = ("error", "best")
ON_FAILURE = (None, "error", "fallback")
BUDGET_SCOPES = ("step", "graph")
BACKWARD_ORDERS = ("auto", "autograd", "sunk")
PRECISIONS = ("fp32", "bf16", "fp16")
FP8_RECIPES = ("tensorwise", "rowwise")
FP8_MATMULS = ("auto", "scaled_mm", "emulated")
FP8_GRAD_DTYPES = ("e5m2", "e4m3")
FP8_SELECTS = ("auto", "faster", "all")
DUMP_DIR_ENV = "DPCS_DUMP_DIR"
HARDWARE_PROFILE_ENV = "DPCS_HARDWARE_PROFILE"
OPTIONS_ENV = "DPCS_OPTIONS"
CODE_SOURCE = "code"
# Fields dpcs sets on the options of the graphs and variants it compiles (`runtime/variants.py`); refused from
# users, in code and in DPCS_OPTIONS alike (`DpcsOptions.from_dict`).
INTERNAL_OPTIONS = ("step_context", "size_hints", "stands_in_for")
_BYTE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BUDGET_CHOICES = (
    "None (no plan: torch's min-cut partition), bytes as an int > 0, a size string like '6GiB' or '800MB', "
    "a fraction of the device's total memory as a float in (0, 1], or 'auto'"
)


def parse_memory_budget(value: Any) -> int | float | str | None:
    """Normalise a memory_budget option: None, bytes (int), a fraction of device memory (float), or "auto".

    Raises ValueError naming the value and the valid forms.
    """
    def bad() -> ValueError:
        return ValueError(f"dpcs option 'memory_budget'={value!r} is not valid; valid choices: {_BUDGET_CHOICES}")

    if value is None or value == "auto":
        return value
    if isinstance(value, bool):
        raise bad()
    if isinstance(value, int):
        if value <= 0:
            raise bad()
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise bad()
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _BYTE_UNITS | {"": 1}:
            raise bad()
        nbytes = int(float(match.group(1)) * _BYTE_UNITS.get(match.group(2).lower(), 1))
        if nbytes <= 0:
            raise bad()
        return nbytes
    raise bad()


def _reads_profile_files() -> bool:
    """Whether this process reads a hardware profile file itself: not on ranks other than 0 of a distributed
    job, which take rank 0's profile (the file may exist on rank 0's machine only)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def _patterns(key: str, value: Any) -> tuple[str, ...]:
    """A list of module-name patterns (fnmatch syntax), as a tuple."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
        isinstance(p, str) and p for p in value
    ):
        raise ValueError(
            f"dpcs option {key!r}={value!r} is not valid; valid choices: a list of module-name patterns "
            "(fnmatch syntax, e.g. ['lm_head', '*.norm'])"
        )
    return tuple(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Options:
    """The `fp8` option: which linears run as fp8 matmuls with dynamic scaling, and how.

    recipe: "tensorwise" (one scale per tensor) or "rowwise" (one scale per row of the contraction).
    filter: module-name patterns (fnmatch); a linear is eligible if its module or an enclosing one matches.
    min_size: a linear is eligible if both its in_features and out_features are at least this (fp8 pays
        off only on large matmuls; the quantization passes cost memory traffic).
    margin: scales are fp8_max / amax / 2**margin; a larger margin leaves headroom for growing values.
    matmul: "scaled_mm" (torch._scaled_mm), "emulated" (the same math in fp32), or "auto" (scaled_mm where
        the device runs it, emulated elsewhere, with a warning that emulation gains no speed).
    grad_dtype: the output gradient's fp8 format in backward: "e5m2" (range) or "e4m3" (precision).
    select: which eligible linears run in fp8. "faster": those the hardware profile says are faster in fp8 at
        their shape, casts and scales counted (`cost/fp8.py`); the others stay in the region's dtype, and
        the plan says why. "all": every eligible linear (numerics studies). "auto" (default): "faster" where
        the matmuls are real fp8 matmuls, "all" where they are emulated (emulation is for numerics: it is
        never faster, and a warning says so).
    """

    recipe: str = "tensorwise"
    filter: tuple[str, ...] = ("*",)
    min_size: int = 1024
    margin: float = 0.0
    matmul: str = "auto"
    grad_dtype: str = "e5m2"
    select: str = "auto"

    def __post_init__(self) -> None:
        if self.recipe not in FP8_RECIPES:
            raise ValueError(
                f"dpcs option 'fp8.recipe'={self.recipe!r} is not valid; valid choices: {', '.join(map(repr, FP8_RECIPES))}"
            )
        object.__setattr__(self, "filter", _patterns("fp8.filter", self.filter))
        if isinstance(self.min_size, bool) or not isinstance(self.min_size, int) or self.min_size < 16:
            raise ValueError(f"dpcs option 'fp8.min_size'={self.min_size!r} is not valid; valid choices: an int >= 16")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin <= 16:
            raise ValueError(f"dpcs option 'fp8.margin'={self.margin!r} is not valid; valid choices: a number in [0, 16]")
        object.__setattr__(self, "margin", float(self.margin))
        if self.matmul not in FP8_MATMULS:
            raise ValueError(
                f"dpcs option 'fp8.matmul'={self.matmul!r} is not valid; valid choices: {', '.join(map(repr, FP8_MATMULS))}"
            )
        if self.grad_dtype not in FP8_GRAD_DTYPES:
            raise ValueError(
                f"dpcs option 'fp8.grad_dtype'={self.grad_dtype!r} is not valid; valid choices: "
                f"{', '.join(map(repr, FP8_GRAD_DTYPES))}"
            )
        if self.select not in FP8_SELECTS:
            raise ValueError(
                f"dpcs option 'fp8.select'={self.select!r} is not valid; valid choices: "
                f"{', '.join(map(repr, FP8_SELECTS))}"
            )

    @classmethod
    def parse(cls, value: Any) -> Fp8Options | None:
        if value is None or value is False or isinstance(value, Fp8Options):
            return value or None
        if value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(
                f"dpcs option 'fp8'={value!r} is not valid; valid choices: None, False, True, or a dict with keys "
                "'recipe', 'filter', 'min_size', 'margin', 'matmul', 'grad_dtype'"
            )
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in valid:
                raise ValueError(f"unknown dpcs option 'fp8.{key}'; valid keys: {', '.join(map(repr, valid))}")
        return cls(**value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpcsOptions:
    """Every option the backend accepts.

    compiler: the final compiler of the partitioned graphs: "inductor", or "eager" to run them uncompiled
        (for tests and debugging; the graphs are the same ones Inductor would get).
    strict: raise when a dpcs stage fails, instead of warning and going on without it (a graph dpcs cannot
        compile: see on_failure).
    dump_dir: write graphs, plans and memory timelines of every compiled graph under this folder
        (defaults to the DPCS_DUMP_DIR environment variable).
    memory_budget: bound on the real peak memory of each compiled training step (parameters, gradients,
        inputs, saved activations, temporaries, recomputation): bytes (int), a size string ("6GiB",
        "800MB"), a fraction of the device's total memory (float in (0, 1]), or "auto" (the device's free
        memory less a margin). None: no plan, torch's min-cut partition.
    budget_scope: "step" (the budget bounds the whole training step: the graphs of one step, split by graph
        breaks or DDP buckets, share it, each planned against what the others keep alive; the step's order
        is learned on its first run and the graphs re-planned once, as runtime variants) or "graph" (each
        graph planned alone against the whole budget: a step of several graphs can exceed it).
    on_infeasible: when no plan fits the budget: "error" raises, naming the smallest peak dpcs can reach;
        "best" compiles the plan with that smallest peak and warns.
    on_failure: when dpcs cannot compile a graph (a stage raised): "error" raises a `PlanningError` naming the
        graph and the cause; "fallback" warns and compiles the graph with plain Inductor, its memory_budget not
        applied. None (default): "error" with a memory_budget (a fallback would drop the budget in silence) or
        with strict=True, "fallback" without. strict=True with "fallback" is refused.
    precision: "fp32", or "bf16" / "fp16": matmuls, linears, convolutions and attention run in that dtype,
        reductions, norms, softmax and losses in fp32 (`passes/rewrite/precision.py`). fp16 needs loss
        scaling (torch.amp.GradScaler).
    keep_fp32: module-name patterns (fnmatch, e.g. ["lm_head", "*.norm"]) whose ops all stay in fp32.
    fp8: None (or False), or the fp8 linear regions (`Fp8Options`, given as a dict; True for the defaults).
    detect_overflow: whether the compiled backward raises a device-side flag when a gradient is inf or NaN
        (`ops/overflow.py`); None: on for fp16 and fp8, off otherwise.
    hardware_profile: what the memory plan is costed with (`cost/profiles.py`): "measure" (the device's
        profile, measured once and cached), a built-in name ("h100", "a100", "l4", "rtx4090",
        "reference-cpu"), a path to a profile JSON file, or a HardwareProfile; defaults to the
        DPCS_HARDWARE_PROFILE environment variable, else "measure".
    rank_agreement: with torch.distributed initialized, every rank plans with rank 0's hardware profile and
        a memory budget every rank can hold, and the ranks compare plan hashes once per compiled training
        graph (an error names what differs). False for jobs whose ranks compile different graphs
        (pipeline stages): each rank then plans alone.
    keep_torch_plan: with a memory_budget, compile torch's own partition (min-cut) when it fits the budget,
        so a budget nothing presses costs nothing (`stages/partition.py`); False: dpcs plans every graph
        (at such a budget, its plan that saves every value the backward reads).
    backward_order: with a memory_budget, the node order of a planned backward graph
        (`passes/rewrite/backward_order.py`): "sunk" moves ops to just before their readers where no buffer
        lives longer, kept where it simulates a lower backward peak; "autograd" keeps autograd's order;
        "auto" (default) sinks with compiler="eager", whose graphs run in that order; under Inductor, whose
        fusion and reordering start from the order given (measured both lower and higher there), only a plan
        over its budget whose sunk order simulates lower, and only where Inductor schedules it lower (both
        orders scheduled, `stages/compile_parts.PartCompiler.lowest_scheduled_backward`).
    calibrate: with a memory_budget, time the graph's own ops once (its joint graph run op by op on made-up
        inputs of its shapes) and plan with the roofline fitted to them: compute and memory scales and the
        per-op cost (`stages/calibrate.py`); False: the hardware profile's roofline.
    calibration: with a memory_budget, plan with this roofline calibration: a `Calibration` or a dict of
        compute_scale, memory_scale and overhead_s (seconds per op; None: the profile's), such as
        `cost.calibration.fit_step_calibration` fits to measured step times of earlier plans (`dpcs bench
        --calibrate steps` shows how); None (default): the profile's roofline, or option `calibrate`'s fit.
    step_context: set by dpcs, not by users: what the other graphs of the step hold around this one
        (`cost.step_model.StepContext`), from the step planner (`step/`).
    size_hints: set by dpcs, not by users: for a graph with dynamic shapes, the sizes its plan is made for
        (pairs of shape symbol and size; empty: the traced sizes), one size bucket of `runtime/variants.py`.
    stands_in_for: set by dpcs, not by users: the compiler this graph is planned for while it runs with
        `compiler` for now (a first plan that holds least runs uncompiled until its step is planned,
        `runtime/variants.py`); the step planner plans it as that compiler will run it (`GraphJob.step_view`).
    option_sources: set by dpcs: where each option that was given came from ("code", "DPCS_OPTIONS (...)",
        or an environment variable), as (name, source) pairs; options left out are the defaults.
    """

    compiler: str = "inductor"
    strict: bool = False
    dump_dir: Path | None = None
    memory_budget: int | float | str | None = None
    on_infeasible: str = "error"
    on_failure: str | None = None
    precision: str = "fp32"
    keep_fp32: tuple[str, ...] = ()
    fp8: Fp8Options | None = None
    detect_overflow: bool | None = None
    hardware_profile: ProfileSpec = MEASURE
    rank_agreement: bool = True
    budget_scope: str = "step"
    keep_torch_plan: bool = True
    backward_order: str = "auto"
    calibrate: bool = False
    calibration: Calibration | None = None
    step_context: StepContext | None = None
    size_hints: tuple[tuple[str, int], ...] = ()
    stands_in_for: str | None = None
    option_sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.compiler not in COMPILERS:
            raise ValueError(
                f"dpcs option 'compiler'={self.compiler!r} is not valid; valid choices: {', '.join(map(repr, COMPILERS))}"
            )
        if not isinstance(self.strict, bool):
            raise ValueError(f"dpcs option 'strict'={self.strict!r} is not valid; valid choices: True, False")
        if self.dump_dir is not None:
            if not isinstance(self.dump_dir, (str, os.PathLike)) or str(self.dump_dir) == "":
                raise ValueError(
                    f"dpcs option 'dump_dir'={self.dump_dir!r} is not valid; valid choices: a folder path (str or "
                    "os.PathLike) or None"
                )
            object.__setattr__(self, "dump_dir", Path(self.dump_dir))
        object.__setattr__(self, "memory_budget", parse_memory_budget(self.memory_budget))
        if self.on_infeasible not in ON_INFEASIBLE:
            raise ValueError(
                f"dpcs option 'on_infeasible'={self.on_infeasible!r} is not valid; valid choices: "
                f"{', '.join(map(repr, ON_INFEASIBLE))}"
            )
        if self.on_failure not in ON_FAILURE:
            raise ValueError(
                f"dpcs option 'on_failure'={self.on_failure!r} is not valid; valid choices: "
                f"{', '.join(map(repr, ON_FAILURE))}"
            )
        if self.strict and self.on_failure == "fallback":
            raise ValueError(
                "dpcs options 'strict'=True and 'on_failure'='fallback' contradict each other (strict raises where a "
                "graph would fall back); valid choices: one of them"
            )
        if self.budget_scope not in BUDGET_SCOPES:
            raise ValueError(
                f"dpcs option 'budget_scope'={self.budget_scope!r} is not valid; valid choices: "
                f"{', '.join(map(repr, BUDGET_SCOPES))}"
            )
        object.__setattr__(self, "step_context", StepContext.parse(self.step_context))
        hints = self.size_hints
        if isinstance(hints, dict):
            hints = tuple(sorted(hints.items()))
        if not isinstance(hints, (tuple, list)) or not all(
            isinstance(h, (tuple, list)) and len(h) == 2 and isinstance(h[0], str)
            and isinstance(h[1], int) and not isinstance(h[1], bool) and h[1] > 0
            for h in hints
        ):
            raise ValueError(
                f"dpcs option 'size_hints'={self.size_hints!r} is not valid; valid choices: pairs of shape symbol "
                "name and size > 0 (set by dpcs for dynamic shapes)"
            )
        object.__setattr__(self, "size_hints", tuple(sorted((str(n), int(v)) for n, v in hints)))
        if self.stands_in_for is not None and (self.stands_in_for not in COMPILERS or self.stands_in_for == self.compiler):
            raise ValueError(
                f"dpcs option 'stands_in_for'={self.stands_in_for!r} is not valid; valid choices: None, or a compiler "
                f"other than compiler={self.compiler!r} ({', '.join(map(repr, COMPILERS))}; set by dpcs)"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"dpcs option 'precision'={self.precision!r} is not valid; valid choices: {', '.join(map(repr, PRECISIONS))}"
            )
        object.__setattr__(self, "keep_fp32", _patterns("keep_fp32", self.keep_fp32))
        object.__setattr__(self, "fp8", Fp8Options.parse(self.fp8))
        if self.detect_overflow not in (None, True, False):
            raise ValueError(
                f"dpcs option 'detect_overflow'={self.detect_overflow!r} is not valid; valid choices: None, True, False"
            )
        if not isinstance(self.calibrate, bool):
            raise ValueError(f"dpcs option 'calibrate'={self.calibrate!r} is not valid; valid choices: True, False")
        object.__setattr__(self, "calibration", _calibration(self.calibration))
        if self.calibrate and self.calibration is not None:
            raise ValueError(
                "dpcs options 'calibrate'=True and 'calibration' both choose the roofline a plan is costed with; "
                "valid choices: one of them"
            )
        if not isinstance(self.keep_torch_plan, bool):
            raise ValueError(
                f"dpcs option 'keep_torch_plan'={self.keep_torch_plan!r} is not valid; valid choices: True, False"
            )
        if self.backward_order not in BACKWARD_ORDERS:
            raise ValueError(
                f"dpcs option 'backward_order'={self.backward_order!r} is not valid; valid choices: "
                f"{', '.join(map(repr, BACKWARD_ORDERS))}"
            )
        if not isinstance(self.rank_agreement, bool):
            raise ValueError(
                f"dpcs option 'rank_agreement'={self.rank_agreement!r} is not valid; valid choices: True, False"
            )
        object.__setattr__(
            self, "hardware_profile", parse_profile_spec(self.hardware_profile, source="dpcs option 'hardware_profile'")
        )
        if (
            isinstance(self.hardware_profile, Path)
            and not self.hardware_profile.is_file()
            and (_reads_profile_files() or not self.rank_agreement)
        ):
            raise ValueError(
                f"dpcs option 'hardware_profile' (or {HARDWARE_PROFILE_ENV}): no profile file at "
                f"{str(self.hardware_profile)!r}; valid choices: {profile_choices()}"
            )

    @property
    def falls_back(self) -> bool:
        """Whether a graph dpcs cannot compile is compiled by plain Inductor with a warning (`on_failure`)
        rather than raising."""
        if self.on_failure is not None:
            return self.on_failure == "fallback"
        return not self.strict and self.memory_budget is None

    @property
    def overflow_detected(self) -> bool:
        """Whether the backward checks its gradients (`detect_overflow`, or its default)."""
        if self.detect_overflow is not None:
            return self.detect_overflow
        return self.precision == "fp16" or self.fp8 is not None

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> DpcsOptions:
        """Build options from the dict given to torch.compile, over those of the DPCS_OPTIONS environment
        variable (JSON, or a path to a JSON or TOML file): the code's win key by key. DPCS_DUMP_DIR fills an
        unset dump_dir and DPCS_HARDWARE_PROFILE an unset hardware_profile. A bad key or value from the
        environment is named with the variable it came from."""
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"dpcs options must be a dict, got {type(options).__name__}")
        code = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls) if f.name != "option_sources" and f.name not in INTERNAL_OPTIONS]
        for key in code:
            if key not in valid:
                why = " (set by dpcs for the graphs it plans, not by users)" if key in INTERNAL_OPTIONS else ""
                raise ValueError(f"unknown dpcs option {key!r}{why}; valid options: {', '.join(map(repr, valid))}")
        environment, env_source = environment_options(valid)
        options = {**environment, **code}
        sources = {key: env_source for key in environment} | {key: CODE_SOURCE for key in code}
        if options.get("dump_dir") is None and os.environ.get(DUMP_DIR_ENV):
            options["dump_dir"] = os.environ[DUMP_DIR_ENV]
            sources["dump_dir"] = f"environment variable {DUMP_DIR_ENV}"
        if options.get("hardware_profile") is None and os.environ.get(HARDWARE_PROFILE_ENV):
            options["hardware_profile"] = parse_profile_spec(
                os.environ[HARDWARE_PROFILE_ENV], source=f"environment variable {HARDWARE_PROFILE_ENV}"
            )
            sources["hardware_profile"] = f"environment variable {HARDWARE_PROFILE_ENV}"
        elif options.get("hardware_profile", MEASURE) is None:
            options["hardware_profile"] = MEASURE
        try:
            return cls(**options, option_sources=tuple(sorted(sources.items())))
        except ValueError as error:
            named = [key for key in environment if key not in code and f"'{key}'" in str(error)]
            if named:
                raise ValueError(f"{error} (key {named[0]!r} of {env_source})") from None
            raise

    def to_json(self) -> dict[str, Any]:
        def plain(value: Any) -> Any:
            if isinstance(value, Path):
                return str(value)
            if isinstance(value, HardwareProfile):
                return json.loads(profile_to_json(value))
            if isinstance(value, StepContext):
                return value.to_json()
            if isinstance(value, Calibration):
                return dataclasses.asdict(value)
            if isinstance(value, Fp8Options):
                return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(value).items()}
            if isinstance(value, tuple):
                return [list(v) if isinstance(v, tuple) else v for v in value]
            return value

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @property
    def sinks_backward(self) -> bool:
        """Whether a planned backward is compiled in its sunk order where that simulates lower (`backward_order`)."""
        return self.backward_order == "sunk" or (self.backward_order == "auto" and self.compiler == "eager")

    def fingerprint(self) -> str:
        """Stable hash of the options that change compiled code (the dump folder, strictness, on_failure and the
        budget's scope do not: a step's context does; the hardware profile is in the plan as the profile itself,
        wherever it came from)."""
        relevant = {
            k: v for k, v in self.to_json().items()
            if k not in ("dump_dir", "strict", "on_failure", "hardware_profile", "rank_agreement", "budget_scope",
                         "option_sources")
        }
        for internal in ("step_context", "size_hints", "stands_in_for"):  # set by dpcs; left out unset, so older hashes stay
            if not relevant[internal]:
                del relevant[internal]
        if relevant.get("step_context"):  # unset fields added since, left out so older hashes stay
            relevant["step_context"] = {k: v for k, v in relevant["step_context"].items()
                                        if not (k in ("first_step", "known_excess") and not v)}
        if relevant["keep_torch_plan"]:  # the defaults, left out so older hashes stay
            del relevant["keep_torch_plan"]
        if not relevant["calibrate"]:
            del relevant["calibrate"]
        if relevant["calibration"] is None or self.memory_budget is None:  # without a budget: no plan to cost
            del relevant["calibration"]
        if relevant["backward_order"] == "auto":
            del relevant["backward_order"]
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def _calibration(value: Any) -> Calibration | None:
    """Option `calibration`: None, a Calibration, or a dict of its fields (ValueError naming what is wrong)."""
    if value is None or isinstance(value, Calibration):
        return value
    valid = "None, a Calibration, or a dict of compute_scale, memory_scale and overhead_s (>= 0; overhead_s may be None)"
    if not isinstance(value, dict) or not value or set(value) - set(CALIBRATION_FIELDS):
        raise ValueError(f"dpcs option 'calibration'={value!r} is not valid; valid choices: {valid}")
    try:
        return Calibration(**value)
    except ValueError as error:
        raise ValueError(f"dpcs option 'calibration'={value!r} is not valid ({error}); valid choices: {valid}") from None


CALIBRATION_FIELDS = tuple(f.name for f in dataclasses.fields(Calibration))


def environment_options(valid: list[str]) -> tuple[dict[str, Any], str]:
    """The options of the DPCS_OPTIONS environment variable, and how to name where they came from: JSON
    text (starting with "{"), or the path of a .json or .toml file. Empty: no options. An unreadable value
    or an unknown key raises, naming the variable (and the file)."""
    raw = os.environ.get(OPTIONS_ENV, "").strip()
    if not raw:
        return {}, OPTIONS_ENV
    if raw.startswith("{"):
        source = f"environment variable {OPTIONS_ENV}"
        try:
            loaded = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source} is not valid JSON: {error}; valid choices: a JSON object of dpcs "
                             f"options, or the path of a .json or .toml file of them") from None
    else:
        path = Path(raw).expanduser()
        source = f"{OPTIONS_ENV} file {str(path)!r}"
        if path.suffix not in (".json", ".toml"):
            raise ValueError(f"environment variable {OPTIONS_ENV}={raw!r} is not valid; valid choices: a JSON "
                             f"object of dpcs options, or the path of a .json or .toml file of them")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"{source} cannot be read: {error}") from None
        try:
            if path.suffix == ".json":
                loaded = json.loads(text)
            else:
                import tomllib

                loaded = tomllib.loads(text)
        except ImportError:
            raise ValueError(f"{source}: TOML needs Python 3.11 or later; use a .json file") from None
        except ValueError as error:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
            raise ValueError(f"{source} does not parse: {error}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{source} holds {type(loaded).__name__}; valid choices: an object (table) of dpcs options")
    for key in loaded:
        if key not in valid:
            raise ValueError(f"unknown dpcs option {key!r} in {source}; valid options: {', '.join(map(repr, valid))}")
    return loaded, source


def config_from(config_type: type, config: Any, fields: dict[str, Any], owner: str) -> Any:
    """`config`, or one made of `fields` (keywords), never both: a policy's (or runtime's) configuration."""
    if config is not None and fields:
        raise ValueError(f"{owner} takes config= or its fields as keywords, not both")
    if config is not None and not isinstance(config, config_type):
        raise ValueError(f"{owner} config={config!r} is not valid; valid choices: a {config_type.__name__}")
    if config is not None:
        return config
    valid = [f.name for f in dataclasses.fields(config_type)]
    unknown = sorted(set(fields) - set(valid))
    if unknown:
        raise ValueError(f"{owner} got unknown options {unknown}; valid choices: {', '.join(map(repr, valid))}")
    return config_type(**fields)
