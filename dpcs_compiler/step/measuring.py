"""Holding a planned step against its measurement: the optimizer step's temporaries, the step's measured
peak read after its backwards, and the correction that plans the step again with what it held beyond its
plan (`MAX_CORRECTIONS` times per shape). `Measuring` is that part of the `StepRecorder` (`recorder.py`)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.cost.step_model import (
    StepShape,
)
from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.cost.budget import CORRECTION_MIN_BYTES, CORRECTION_MIN_FRACTION
from dpcs_compiler.cost.model_state import (
    estimated_step_transient,
)
from dpcs_compiler.stages.job import describe_budget
from dpcs_compiler.step.calls import MAX_CORRECTIONS, MAX_TRANSIENT_UPDATES, STABLE_STEPS, _covering
from dpcs_compiler.step.holdings import _decoded, _inner, _offloaded_now, _regime, _state_bytes
from dpcs_compiler.step.meter import _Meter, _OptimizerMeter
from dpcs_compiler.step.records import _say_infeasible

log = logging.getLogger("dpcs.step")


class Measuring:
    """The `StepRecorder`'s measuring of planned steps (module docs)."""

    def optimizer_starts(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer's step starts (every optimizer's step pre-hook): the step before it is read, what it holds
        now included, and the optimizer step is measured if it follows a watched step."""
        if _inner(optimizer):
            return
        if self.due is not None:
            self.finish_reading(at_optimizer_step=True)
        if self.optimizer_key is not None and self.optimizer_meter is None:
            # None where it cannot be measured (another profiler runs on CPU): nothing is learnt from this one.
            self.optimizer_meter = _OptimizerMeter.start(optimizer)

    def optimizer_ends(self, optimizer: torch.optim.Optimizer) -> None:
        meter = self.optimizer_meter
        if meter is not None and meter.optimizer() is optimizer:
            self.optimizer_meter = None
            transient, grown = meter.read()
            steady = grown <= max(CORRECTION_MIN_BYTES, int(CORRECTION_MIN_FRACTION * transient))
            self.optimizer_seen[steady] = max(self.optimizer_seen.get(steady, 0), transient)

    def _optimizer_measured(self) -> None:
        """The optimizer steps after the last watched step are over (its next forward call starts): what they
        allocated beyond their start and end is the step's optimizer-step temporaries under the way the model
        state is kept now (`_regime`; other ways are estimated from it, `_optimizer_bytes`). A step that made new
        state (a first step) counts only until a steady one is measured; a steady figure replaces what was known
        when it differs. The step is planned again when it changes. In a distributed job the ranks' figures are
        combined (the largest)."""
        key, seen = self.optimizer_key, self.optimizer_seen
        self.optimizer_key, self.optimizer_seen = None, {}
        if self.optimizer_meter is not None:  # a step that never ended (it raised)
            self.optimizer_meter.discard()
            self.optimizer_meter = None
        steady = True in seen
        value = seen[True] if steady else seen.get(False)
        if self._ranks_agree():
            everyone = [v for v in rank_agreement.every_rank((value, steady)) if v[0] is not None]
            steady = any(s for _, s in everyone)
            value = max((v for v, s in everyone if s == steady), default=None)
        if value is None or key not in self.shapes:
            return
        regime = _regime(self.optimizers, _offloaded_now())
        table = self.transient_measured.setdefault(key, {})
        known, known_steady = table.get(regime, (None, False))
        tolerance = max(CORRECTION_MIN_BYTES, int(CORRECTION_MIN_FRACTION * value))
        if known is not None and (known_steady and not steady or steady == known_steady and abs(value - known) <= tolerance
                                  or self.transient_updates.get(key, 0) > MAX_TRANSIENT_UPDATES):
            return
        table[regime] = (value, steady)
        self.transient_updates[key] = self.transient_updates.get(key, 0) + 1
        shape, refs = self.shapes[key]
        self.shapes[key] = (dataclasses.replace(shape, optimizer_bytes=self._optimizer_bytes(key)), refs)
        log.info("dpcs: the optimizer step after the step allocated %d B beyond its start and end (%s)%s", value,
                 "steady" if steady else "making its state", "; planned again" if not self.to_plan else "")
        self.quiet = 0
        self.to_plan = True

    def _transients(self, key: tuple) -> dict[tuple, int]:
        """A step shape's measured optimizer-step temporaries by `_regime`: the steady ones once there are any
        (a first step's, making its state, says little about a later one's)."""
        table = self.transient_measured.get(key, {})
        steady = any(s for _, s in table.values())
        return {regime: nbytes for regime, (nbytes, s) in table.items() if s or not steady}

    def _optimizer_bytes(self, key: tuple) -> int | None:
        """A step shape's `optimizer_bytes` as the model state is kept now: its optimizer step's temporaries
        (measured, or estimated from other regimes) and what the loop held beyond its plan at its end."""
        transient = estimated_step_transient(self._transients(key), _regime(self.optimizers, _offloaded_now()),
                                             _decoded(self.optimizers, self.blocks))
        return None if transient is None else transient + self.end_measured.get(key, 0)

    def finish_reading(self, at_optimizer_step: bool = False) -> None:
        """Read the measured step (from the training thread, outside a backward: a CPU profiler is stopped
        here), and count what it shows; read at an optimizer's step, what the step holds at its end too. In a
        distributed job every rank reads at the same point of its training loop and the ranks' readings are
        combined (the largest), so every rank decides alike."""
        due, self.due = self.due, None
        if due is None:
            return
        meter, step = due
        reading = meter.read(step[3], at_optimizer_step) if meter is not None and step is not None else None
        if reading is not None:
            reading = tuple(None if r is None else r - step[4] for r in reading)
            reading = self._with_reserved_excess(meter, reading)
        if meter is not None:
            meter.discard()
        if self._ranks_agree():
            readings = [r for r in rank_agreement.every_rank(reading) if r is not None]
            reading = tuple(max((r[i] for r in readings if r[i] is not None), default=None) for i in range(3)) \
                if readings else None
        if step is not None:
            key, shape, refs, _, _ = step
            self._settle(key, shape, refs, reading)

    def _with_reserved_excess(self, meter: _Meter, reading: tuple) -> tuple:
        """On CUDA, a measured step whose caching allocator reserved more than the budget (allocated bytes
        within it, the allocator's share exceeded): the excess counted as memory held outside the graphs through
        the step, so the step is planned again with that much less room (`_correct`)."""
        budgets = [b for d in self.participants if (b := d.current_reserved_budget_bytes) is not None]
        if meter.reserved_peak is None or meter.trace is None or not budgets:
            return reading
        budget = min(budgets)
        # Only what the step itself reserved beyond the budget counts: memory reserved before it (by earlier
        # plans, or the user's code) is the allocator's cache, given back here instead.
        excess = meter.reserved_peak - max(budget, meter.trace.reserved)
        if int(torch.cuda.memory_reserved(meter.device)) > budget:
            torch.cuda.empty_cache()  # cached blocks no tensor uses go back to the device
            log.info("dpcs: the caching allocator held more than the budget of %d B: its unused cache given back "
                     "(now %d B reserved)", budget, torch.cuda.memory_reserved(meter.device))
        if excess <= 0:
            return reading
        log.warning("dpcs: the step reserved %d B on the device, %d B over its budget of %d B (the allocator's "
                    "share of the budget was too small): planned again with that much less", meter.reserved_peak,
                    excess, budget)
        return (reading[0] + excess, reading[1] + excess, reading[2])

    def _settle(self, key: tuple, shape: StepShape, refs: list, measured: tuple[int, int, int | None] | None) -> None:
        """A complete step of `shape`: count what its measurement (if any) shows beyond the plan, then plan it
        if it is new or more demanding than the shape known, or count it towards stopping the watch."""
        shape = dataclasses.replace(
            shape,
            outside_bytes=shape.outside_bytes + self.outside_measured.get(key, 0),
            turn_bytes=shape.turn_bytes + self.turn_measured.get(key, 0),
            optimizer_bytes=self._optimizer_bytes(key),
        )
        corrected = False
        if measured is not None and self.predicted is not None:
            self._correct(key, shape, measured, refs)
            corrected = self.to_plan
        # Known only for the same graphs (a new compile may reuse the names of graphs gone).
        same = key in self.shapes and [r() for r in self.shapes[key][1]] == [r() for r in refs]
        known = self.shapes[key][0] if same else None
        covered = _covering(known, shape) if known is not None else shape
        # Other optimizers than this step's plan counted, or their state made by a first step (or grown) since:
        # planned for.
        planned_ids, planned_bytes = self.planned_state.get(key, (None, 0))
        grown = ({id(o) for o in self.optimizers} != planned_ids
                 or _state_bytes(self.optimizers) > planned_bytes + CORRECTION_MIN_BYTES)
        new = (covered != known or grown) and not corrected
        if self._ranks_agree():
            # Whether a step needs planning is decided by every rank alike (planning takes collectives): a
            # figure read from storages (which inputs an earlier call holds) can differ between ranks.
            new = any(rank_agreement.every_rank(new))
        if corrected:
            return
        if not new:
            self.quiet += 1
            # Not while a plan made is still to be checked (`_predict_as_compiled`, then measured): a step planned
            # again because its compiled variants went over, or well under, its budget was never checked.
            if self.quiet >= STABLE_STEPS and self.verify_in is None and not self.to_plan:
                log.info("dpcs: step order stable; step watching stops")
                self.disarm()
            return
        self.shapes[key] = (covered, refs)
        self.quiet = 0
        self.to_plan = True

    def _ranks_agree(self) -> bool:
        """In a distributed job whose graphs agree on plans, every rank takes the step recorder's decisions."""
        return rank_agreement.world() is not None and all(d.options.rank_agreement for d in self.participants)

    def _correct(self, key: tuple, shape: StepShape, measured: tuple[int, int, int | None], refs: list) -> None:
        """Count what a measured planned step held beyond its plan, and plan it again (at most twice a shape).

        `measured` and `self.predicted` are (the peak outside the step's turn, at its turn, held when its
        backwards ended; measured only when an optimizer step follows). Beyond the plan outside the turn
        (memory no graph shows: collectives in flight, eager code between graphs) counts as alive throughout
        the step; beyond it at the turn (a loss in eager code) counts at the turn only; beyond it at the end
        (what the training loop holds then: a loss's logits) counts in the optimizer step."""
        assert self.predicted is not None
        predicted_graphs, predicted_turn, predicted_end = self.predicted
        tolerance = max(CORRECTION_MIN_BYTES, int(CORRECTION_MIN_FRACTION * max(self.predicted)))
        if self.fitted_budget is not None and max(measured[0], measured[1]) > self.fitted_budget:
            tolerance = 0  # a plan that fit its budget measured over it: any excess counts, however small
        outside = max(0, measured[0] - predicted_graphs)
        outside = outside if outside > tolerance else 0
        turn = max(0, measured[1] - predicted_turn - outside)  # the turn's prediction counts `outside` too
        turn = turn if turn > tolerance else 0
        end = max(0, measured[2] - predicted_end - outside) if measured[2] is not None else 0
        end = end if end > tolerance and shape.optimizer_bytes is not None else 0
        if not outside and not turn and not end:
            return
        if self.corrections.get(key, 0) >= MAX_CORRECTIONS:
            participants = list(self.participants)
            budget = self.fitted_budget if self.fitted_budget is not None else min(
                (b for d in participants if (b := d.current_budget_bytes) is not None), default=None)
            peak = max(measured[0], measured[1])
            if budget is not None and peak > budget:  # the budget is not held: said as a plan no budget fits is
                _say_infeasible(
                    f"{describe_budget(budget)} is not held by the training step: it measured {format_bytes(peak)} "
                    f"({peak} B) after {MAX_CORRECTIONS} plans counting what it held beyond each, "
                    f"{max(outside, turn, end)} B beyond the last", participants)
            log.warning("dpcs: the step measured %d B beyond its plan again; not planned again", max(outside, turn, end))
            return
        self.outside_measured[key] = self.outside_measured.get(key, 0) + outside
        self.turn_measured[key] = self.turn_measured.get(key, 0) + turn
        self.end_measured[key] = self.end_measured.get(key, 0) + end
        shape = dataclasses.replace(
            shape, outside_bytes=shape.outside_bytes + outside, turn_bytes=shape.turn_bytes + turn,
            optimizer_bytes=None if shape.optimizer_bytes is None else shape.optimizer_bytes + end)
        self.shapes[key] = (shape, refs)
        # Planned again only if what was counted raises the step's predicted peak (a turn below the graphs' peak
        # changes nothing now; later plans of the step count it).
        optimizer_peak = (predicted_end + outside + shape.optimizer_bytes) if shape.optimizer_bytes is not None else 0
        corrected_peak = max(predicted_graphs + outside, predicted_turn + outside + turn, optimizer_peak)
        replan = corrected_peak > self.predicted_peak
        # Torch's partitions measured within the budget are kept: what they held beyond the model is counted
        # (later plans see it) and nothing is compiled again (on HF GPT-2 at compile's own peak they measured
        # 1.1 MB over their compiled prediction, exactly that peak: the same graphs torch.compile runs).
        # (Every rank reads the same step: its readings are combined in `finish_reading`.)
        kept = (replan and self.torch_planned and self.torch_budget is not None
                and max(measured[0], measured[1], optimizer_peak) <= self.torch_budget)
        replan = replan and not kept
        log.info(
            "dpcs: the step measured %d B beyond its plan's %d B outside its turn (counted as memory outside its "
            "graphs), %d B beyond its %d B at its turn (counted as eager code's there) and %d B beyond its %d B "
            "at its end (counted in the optimizer step)%s",
            outside, predicted_graphs, turn, predicted_turn, end, predicted_end,
            "; planned again" if replan else f"; torch's partitions kept, within the budget of {self.torch_budget} B"
            if kept else "",
        )
        if replan:
            if self.torch_planned and outside:  # torch's partitions held more than their compiles read: dpcs plans
                self.torch_refused = True  # from now on (what eager code holds at the turn or the end is not theirs)
            self.corrections[key] = self.corrections.get(key, 0) + 1
            self.quiet = 0
            self.to_plan = True
