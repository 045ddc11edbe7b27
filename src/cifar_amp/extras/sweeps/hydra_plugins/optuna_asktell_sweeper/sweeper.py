"""Ask a batch of trials, launch it through Hydra's launcher, tell each trial how its job ended
(docs/scaling.md). optuna is imported where it is used: Hydra imports every plugin at start-up.
"""

import logging
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import CompactHydraException
from hydra.plugins.sweeper import Sweeper
from hydra.utils import call, instantiate
from omegaconf import DictConfig, OmegaConf

from . import compat
from .trial import PRUNED_AT, STORAGE, STUDY_NAME, TRIAL_ID

log = logging.getLogger(__name__)
# A failed job's one-line reason, in its dir (cifar_amp.extras.multirun.multirun writes those it reports); the sweep's
# summary names every job that has one and exits 2.
ERROR_FILE = "error.txt"


def distribution(override: Override) -> Any:
    """`interval(a, b)`: a float range (tagged `log`: on a log scale); an ascending int `range`:
    a stepped int range; any other sweep (`choice`, `a,b,c`): categories."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    sweep = override.value()
    if isinstance(sweep, IntervalSweep):
        return FloatDistribution(sweep.start, sweep.end, log="log" in sweep.tags)
    choices = list(override.sweep_iterator())
    if isinstance(sweep, RangeSweep) and len(choices) > 1 and all(type(c) is int for c in choices):
        steps = {b - a for a, b in zip(choices, choices[1:], strict=False)}
        if len(steps) == 1 and (step := steps.pop()) > 0:  # not shuffled, ascending
            return IntDistribution(choices[0], choices[-1], step=step)
    return CategoricalDistribution(choices)


def search_space(params: List[str], arguments: List[str]) -> Tuple[Dict[str, Any], List[str]]:
    """(key -> distribution, the fixed overrides): the command line wins over `params`."""
    parser = OverridesParser.create()
    space: Dict[str, Any] = {}
    fixed: Dict[str, str] = {}
    for o in parser.parse_overrides(params) + parser.parse_overrides(arguments):
        key = o.get_key_element()
        if o.is_sweep_override():
            space[key] = distribution(o)
            fixed.pop(key, None)
        else:
            fixed[key] = o.input_line
            space.pop(key, None)
    return space, list(fixed.values())


def quoted(value: Any) -> str:
    """A Hydra quoted string: backslashes before a quote (or the end) doubled, quotes escaped."""
    body = re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + "\\" * bool(m[2]) + m[2], str(value))
    return f"'{body}'"


def override_value(value: Any) -> str:
    """`value` as Hydra reads it back: a string quoted where it would otherwise read as
    something else (`'1'`, `'null'`, `'a,b'`), so that job summaries stay plain."""
    if value is None:
        return "null"
    if not isinstance(value, str):
        return str(value)
    try:
        if OverridesParser.create().parse_override(f"k={value}").value() == value:
            return value
    except Exception:  # not an override value unquoted
        pass
    return quoted(value)


def outcome(study: Any, trial: Any, ret: Optional[JobReturn]) -> Tuple[Any, Optional[float], str]:
    """(state, value, the reason of a FAIL or '') of the job that ran `trial`: a finite return
    is COMPLETE, PRUNED_AT or TrialPruned is PRUNED, any other end FAIL."""
    import optuna
    from optuna.trial import TrialState

    if ret is None:
        return TrialState.FAIL, None, "the launcher lost the job"
    if ret.status == JobStatus.COMPLETED:
        # The job wrote to the storage: the study reads it back (`trial` has a cached copy).
        if PRUNED_AT in study.get_trials(deepcopy=False)[trial.number].user_attrs:
            return TrialState.PRUNED, None, ""
        try:
            value = float(ret.return_value)
        except (TypeError, ValueError):
            value = math.nan
        if math.isfinite(value):
            return TrialState.COMPLETE, value, ""
        return TrialState.FAIL, None, f"returned {ret.return_value!r}"
    error = compat.raised(ret)
    if isinstance(error, optuna.TrialPruned):
        return TrialState.PRUNED, None, ""
    log.error(f"Trial {trial.number} raised", exc_info=error)
    return TrialState.FAIL, None, f"{type(error).__name__}: {error}".replace("\n", " ")


def tell(study: Any, trial: Any, ret: Optional[JobReturn]) -> Tuple[str, bool]:
    """Record in the study how the job of `trial` ended (a PRUNED trial keeps its last reported
    value): (the reason of a FAIL or '', whether the sampler has tried everything)."""
    state, value, reason = outcome(study, trial, ret)
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as e:
        # A sampler that is done (grid, brute force) calls Study.stop(), refused outside
        # optimize(); the trial is told all the same.
        if "Study.stop" not in str(e):
            raise
        return reason, True
    return reason, False


class SpaceChanged(CompactHydraException, ValueError):
    """Printed by Hydra as one line (no traceback)."""


def check_space(study: Any, space: Dict[str, Any]) -> None:
    """Optuna cannot compare trials of another space (other choices, int vs float...)."""
    from optuna.distributions import check_distribution_compatibility

    for t in study.get_trials(deepcopy=False):
        for key, old in t.distributions.items():
            try:
                check_distribution_compatibility(old, space.get(key, old))
            except ValueError as e:
                raise SpaceChanged(
                    f"{key}: {e} Study {study.study_name} searched {old}, not {space[key]}; "
                    "give the new search space a new hydra.sweeper.study_name"
                ) from None


class OptunaAskTellSweeper(Sweeper):
    def __init__(
        self,
        study_name: str,
        storage: Optional[str],
        direction: str,
        n_trials: int,
        n_jobs: int,
        sampler: DictConfig,
        pruner: DictConfig,
        params: Optional[DictConfig],
        devices: Optional[List[Any]],
        restrict: Optional[DictConfig] = None,
    ) -> None:
        if n_trials < 1 or n_jobs < 1:
            raise ValueError(f"hydra.sweeper: n_trials={n_trials}, n_jobs={n_jobs}; must be >= 1")
        self.study_name, self.storage, self.direction = study_name, storage, direction
        self.n_trials, self.n_jobs, self.sampler = n_trials, n_jobs, sampler
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.devices = [str(d) for d in devices or []]  # the pruner is the jobs' (trial.py)
        self.restrict = restrict

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: List[str]) -> None:
        try:
            import optuna
        except ImportError as e:  # one line and exit 2, as the template's refusals (Hydra: 3, 1)
            print(
                f"error: hydra/sweeper=optuna_asktell needs optuna, which is not installed "
                f"here: pip install -e '.[sweeps]' ({e})",
                file=sys.stderr,
            )
            sys.exit(2)

        params = call(self.restrict, self.params, self.config) if self.restrict else self.params
        space, fixed = search_space([f"{k}={v}" for k, v in params.items()], arguments)
        if (self.storage or "").startswith("sqlite:///"):  # SQLite does not make the folder
            Path(self.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=self.storage,
            direction=self.direction,
            load_if_exists=True,
        )
        check_space(study, space)
        earlier = len(study.trials)
        # A fixed seed would start each resumed run with the trials of the first one again.
        seed = self.sampler.get("seed")
        study.sampler = instantiate(
            self.sampler, **({} if seed is None else {"seed": seed + earlier})
        )
        log.info(
            f"Study {study.study_name} ({earlier} earlier trials) in {self.storage or 'memory'}: "
            f"{self.n_trials} trials, {self.n_jobs} at a time"
        )
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        ran: List[Tuple[int, Any, str]] = []  # (job number, trial, reason of a FAIL)
        exhausted = False
        while len(ran) < self.n_trials and not exhausted:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - len(ran)))]
            batch = [self.job_overrides(fixed, study, i, t) for i, t in enumerate(trials)]
            try:
                returns: List[Any] = list(self.launcher.launch(batch, initial_job_idx=len(ran)))
            except Exception:  # e.g. a job's process died: the launcher has no results
                log.exception(f"Launching trials {[t.number for t in trials]} failed")
                returns = [None] * len(trials)
            for trial, ret in zip(trials, returns, strict=True):
                job = len(ran)
                reason, done = tell(study, trial, ret)
                if done:
                    exhausted = True
                    log.info(f"The sampler has tried every value after trial {trial.number}")
                if reason:
                    job_dir = Path(
                        ret.hydra_cfg.hydra.runtime.output_dir if ret else sweep_dir / str(job)
                    )
                    if not (job_dir / ERROR_FILE).is_file():
                        job_dir.mkdir(parents=True, exist_ok=True)
                        (job_dir / ERROR_FILE).write_text(f"trial {trial.number}: {reason}\n")
                ran.append((job, trial, reason))
        self.report(study, ran, sweep_dir)

    def job_overrides(self, fixed: List[str], study: Any, i: int, trial: Any) -> List[str]:
        env = {}
        if self.storage:  # in memory, a job's process could not find its trial
            env = {
                STUDY_NAME: study.study_name,
                STORAGE: self.storage,
                TRIAL_ID: compat.trial_id(trial),
            }
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = self.devices[i % len(self.devices)]
        return (
            fixed
            + [f"{k}={override_value(v)}" for k, v in trial.params.items()]
            + [f"++hydra.job.env_set.{k}={quoted(v)}" for k, v in env.items()]
        )

    def report(self, study: Any, ran: List[Tuple[int, Any, str]], sweep_dir: Path) -> None:
        """Each trial of this run in the log and in <sweep dir>/optimization_results.yaml, with
        the best trial of the study."""
        from optuna.trial import TrialState

        all_trials = study.get_trials(deepcopy=False)
        rows = []
        for job, trial, reason in ran:
            t = all_trials[trial.number]
            row = {"job": job, "trial": t.number, "state": t.state.name, "value": t.value}
            row.update(params=dict(t.params))
            if PRUNED_AT in t.user_attrs:
                row["pruned_at"] = t.user_attrs[PRUNED_AT]
            if reason:
                row["error"] = reason
            rows.append(row)
        counts = {s: sum(r["state"] == s for r in rows) for s in ("COMPLETE", "PRUNED", "FAIL")}
        log.info(
            f"Study {study.study_name}: {len(rows)} trials in this run ("
            + ", ".join(f"{n} {s}" for s, n in counts.items())
            + f"), {len(all_trials)} in all"
        )
        for r in rows:
            end = r.get("error") or ("" if r["value"] is None else f"{r['value']:.4g}")
            if "pruned_at" in r:
                end = f"at epoch {r['pruned_at']} ({end})"
            log.info(f"  job {r['job']}, trial {r['trial']}: {r['state']} {end}  {r['params']}")
        results: Dict[str, Any] = {"name": "optuna", "study_name": study.study_name}
        if study.get_trials(deepcopy=False, states=[TrialState.COMPLETE]):
            best = study.best_trial
            results.update(best_trial=best.number, best_params=best.params, best_value=best.value)
            log.info(f"Best: trial {best.number}, {best.value:.4g} with {best.params}")
        results["trials"] = rows
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
