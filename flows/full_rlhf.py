"""The ``full-rlhf`` flow: a pipeline recipe's stages as cached Prefect tasks handing checkpoints on.

The flow holds no training code: it checks the whole pipeline recipe first (:func:`flows.pipeline.plan`:
nothing runs if any stage recipe or wiring is wrong), then runs each stage as the
:func:`flows.tasks.run_stage` task with the stage's retries, passing checkpoint references from stage
to stage. A stage whose cache key (config + input digests + code version) has a stored result that
still verifies comes back Cached; ``refresh`` names stages to rerun regardless. After a failure in
stage k, running the flow again (or retrying the flow run from the UI/CLI) reruns k and what follows.
Each stage's training curves (:mod:`flows.curves`), the eval report (table and plot) and a summary of
the run (each stage's run folder, checkpoint digest and report) are published as markdown artifacts.

Run: ``python -m flows.full_rlhf [recipes/pipelines/tiny.yaml] [--refresh sft,rl] [--output-root runs]``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from checkpoints import CheckpointRef, remembered_hashes
from flows import gates, sweeps
from flows.console import VERBOSE_ENV
from flows.curves import artifact_key, data_uri, prefect_key
from flows.pipeline import PROJECT_ROOT, Plan, plan
from flows.tasks import StageError, cached_result, run_stage, run_stage_on_pool
from stages import registry
from stages.common.cli import DEBUG_ENV, did_you_mean, one_line_errors, take_debug
from stages.common.recipe import RecipeError
from stages.common.stage import StageRun
from stages.eval import EvalReport

DEFAULT_PIPELINE = "recipes/pipelines/tiny.yaml"
PROG = "python -m flows.full_rlhf"


@flow(name="full-rlhf", log_prints=True, persist_result=True, result_serializer="json")
def full_rlhf(
    pipeline: str = DEFAULT_PIPELINE,
    overrides: dict[str, dict[str, Any]] | None = None,
    refresh: list[str] | None = None,
    output_root: str | None = None,
    cluster_address: str | None = None,
    allow_code_overrides: bool = False,
) -> dict[str, Any]:
    """Run ``pipeline``; ``overrides`` maps stage name -> {dotted key: value}; ``refresh`` reruns named stages;
    ``cluster_address``: every training stage on the existing Ray cluster there. ``allow_code_overrides``: read from
    the deployment's own parameters (prefect.yaml), never from a run's: whether a deployment run's ``overrides`` may
    name code to run (``reward.func``, ``rollout.agent``, graders)."""
    refuse_code_overrides(overrides or {}, deployment_allows_code())  # before planning: the plan imports plugins
    p = plan(pipeline, output_root=output_root, stage_overrides=overrides, cluster_address=cluster_address)
    refresh = list(refresh or [])
    check_refresh(p, refresh, pipeline)
    runs: dict[str, StageRun] = {}
    failed: dict[str, str] = {}
    outputs = run_plan(p, refresh=set(refresh), runs=runs, failed=failed)
    metrics = _metrics(p, outputs, runs)
    gated = gates.evaluate([g for g in p.gates if g.owner not in failed], metrics)  # a failed variant's gates: not run
    summary = _stage_summary(outputs)
    result = gates.result_stage(p.gates, [s.spec.name for s in p.stages], {s.spec.name: s.spec.stage for s in p.stages})
    if p.variants:  # a sweep: every variant side by side, the best named; the result is the best variant's
        summary["sweep"] = _publish_sweep(p, pipeline, outputs, runs, failed, metrics)
        result = _best_result(p, summary["sweep"]["best"]) or result
    passed = all(r.passed for r in gated) and not failed
    _publish_summary(pipeline, outputs, runs, gated, result if passed else None)
    for r in gated:
        (logger_info if r.passed else get_run_logger().error)(f"gate {r.gate.owner}: {r.line()}")
    _raise_failed(failed, runs)
    gates.check(gated)
    if result is not None:
        summary["pipeline_result"] = {"stage": result, **summary[result]}
    return summary


def _metrics(p: Plan, outputs: dict[str, Any], runs: dict[str, StageRun]) -> dict[str, dict[str, float]]:
    """What gates (and a sweep's selection) read of each finished stage they name (a sweep: of every stage)."""
    named = {r.split(".")[0] for g in p.gates for r in g.refs()}
    return {name: gates.stage_metrics(out, runs[name].run_dir) for name, out in outputs.items()
            if name in named or p.select is not None}


def _best_result(p: Plan, best: str | None) -> str | None:
    """The best variant's copy of the stage its selection metric belongs to (None: no variant was ranked)."""
    return sweeps.result_of(p.select, next(v for v in p.variants if v["label"] == best)) if best else None


def _raise_failed(failed: dict[str, str], runs: dict[str, StageRun]) -> None:
    """A sweep whose stages failed fails, after everything else ran, naming them and the first one's error."""
    ran = [n for n in failed if n in runs]  # the others were not run: an input of theirs failed
    if ran:
        raise StageError(f"{len(ran)} stage(s) of the sweep failed ({', '.join(failed)}); the other variants finished and "
                         f"the comparison is published. {ran[0]}: {failed[ran[0]]}")


def _stage_summary(outputs: dict[str, Any]) -> dict[str, Any]:
    """Each stage's output (an eval report's table printed and published too)."""
    summary: dict[str, Any] = {}
    for name, out in outputs.items():
        if isinstance(out, EvalReport):
            _publish_report(name, out)
            summary[name] = {"report": out.markdown, "plot": out.plot, "metrics": out.metrics}
            print(f"[full-rlhf] {name} report: {out.markdown}\n{Path(out.markdown).read_text()}")
        else:
            summary[name] = {"path": out.path, "kind": out.kind, "digest": out.digest}
    return summary


def _publish_sweep(p: Plan, pipeline: str, outputs: dict[str, Any], runs: dict[str, StageRun], failed: dict[str, str],
                   metrics: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The sweep comparison as an artifact and as files under the output root; its rows, best variant and files."""
    comp = sweeps.comparison(p.variants, outputs, runs, failed, p.select, lambda name: metrics.get(name, {}))
    files = sweeps.write_files(Path(p.recipe.output_root) / f"sweep-{p.recipe.name}", comp)
    plot = data_uri(Path(files["plot"]).read_bytes()) if "plot" in files else None
    create_markdown_artifact(markdown=sweeps.markdown(comp, plot) + f"\nFiles: `{files['markdown']}`", key="sweep-comparison",
                             description=f"{pipeline}: {len(comp['rows'])} variants, the best first, their overrides, final "
                                         "metrics and held-out curves")
    best = comp["best"]
    print(f"[full-rlhf] sweep: {files['markdown']}" + (f"; best: {sweeps.label(next(v for v in p.variants if v['label'] == best))} "
                                                      f"({best})" if best else ""))
    return {"rows": comp["rows"], "best": best, "files": files}


def logger_info(message: str) -> None:
    get_run_logger().info(message)


def deployment_allows_code() -> bool | None:
    """None outside a deployment run; in one, the deployment's own ``allow_code_overrides`` parameter (what it was
    deployed with: a run's parameters can't grant it)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment

    if deployment.id is None:
        return None
    with get_client(sync_client=True) as client:
        return bool((client.read_deployment(deployment.id).parameters or {}).get("allow_code_overrides"))


def refuse_code_overrides(overrides: dict[str, dict[str, Any]], allowed: bool | None) -> None:
    """A deployment run (``allowed`` not None) whose ``overrides`` set a field that names code for a stage to run (any
    stage's ``plugins``: ``reward.func``, ``rollout.agent``, ``eval_grader``, ``grader``) is refused, naming the field,
    unless the deployment allows it: whoever may start a run must not choose the code it executes."""
    if allowed is None or allowed:
        return
    code_fields = sorted({f for name in registry.STAGES for f in registry.spec(name).plugins})
    for name, fields in overrides.items():
        for key in fields or {}:
            for field in code_fields:
                if key == field or field.startswith(key + ".") or key.startswith(field + "."):
                    raise RecipeError(f"overrides.{name}.{key}: names code for the stage to run ({field}); a deployment run "
                                      "can't set it unless the deployment is deployed with allow_code_overrides: true "
                                      "(its parameters in prefect.yaml)")


def check_refresh(p: Plan, refresh: list[str], pipeline: str) -> None:
    """Every name in ``refresh`` is a stage of the plan (RecipeError with a "did you mean" otherwise)."""
    names = [s.spec.name for s in p.stages]
    for name in refresh:
        if name not in names:
            raise RecipeError(f"--refresh: no stage named {name!r} in {pipeline}{did_you_mean(name, names)} (its stages: {names})")


def run_plan(p: Plan, refresh: set[str] | bool = False, runs: dict[str, StageRun] | None = None,
             failed: dict[str, str] | None = None) -> dict[str, CheckpointRef | EvalReport]:
    """Run a checked plan's stages in order as cached tasks; ``refresh``: stage names (or True: all) to rerun.

    Each stage's identity (:meth:`StageSpec.identify`: config, input digests, file digests, code version)
    is computed once here; it is the task's cache key and names the stage's run folder. Every file is
    hashed once per flow run. In a sweep a failing stage fails its own branch only: it and the stages
    downstream of it go into ``failed`` (name -> why) and the others run on; otherwise the first failure raises."""
    outputs: dict[str, CheckpointRef | EvalReport] = {}
    failed = {} if failed is None else failed
    # a sweep's sweep.max_concurrent > 1: stages are submitted as their inputs finish, at most that many running
    limit = p.recipe.sweep.max_concurrent if p.recipe.sweep is not None else 1
    scheduler = Scheduler(limit, outputs, failed, keep_going=bool(p.variants))
    with remembered_hashes():
        for st in p.stages:
            deps = wired(st.spec)
            scheduler.wait_for(deps)
            blocked = [d for d in deps if d in failed]
            if blocked:
                failed[st.spec.name] = f"not run: its input {blocked[0]!r} failed"
                continue
            inputs, run = st.identify(outputs)
            if runs is not None:
                runs[st.spec.name] = run
            task, force = stage_task(st, run, refresh is True or st.spec.name in (refresh or ()))
            where = {"pool": st.spec.work_pool, "job_variables": st.spec.job_variables} if st.spec.work_pool else {}
            scheduler.start(st.spec.name, task, (st.spec.name, run, st.config.model_dump(mode="json"), inputs),
                            dict(reuse=not force, timeout_s=st.spec.timeout_s, **where))
        scheduler.wait_for(list(scheduler.running))
    return {st.spec.name: outputs[st.spec.name] for st in p.stages if st.spec.name in outputs}


def wired(spec) -> list[str]:
    """The stages a pipeline stage's inputs name."""
    return sorted({x for v in spec.inputs.values() for x in (v if isinstance(v, list) else [v])})


def stage_task(st, run: StageRun, force: bool):
    """The stage's task with its retries and deadline, and the cache decision: refresh it when forced, when the
    cached output is under another output root, gone or altered, or when the cached record is not JSON; and whether
    the run folder's own output is passed over too (forced, or stale)."""
    logger = get_run_logger()
    skip_cache, cached = force, "none" if force else cached_result(run.key, run.run_dir)
    if cached == "elsewhere":  # not an error: this root's output of the identity is picked up, or made, here
        logger.info(f"{st.spec.name}: the cached output of this identity is under another output root; this "
                    f"run's is {run.run_dir}")
        skip_cache = True
    elif cached == "stale":
        logger.warning(f"{st.spec.name}: the cached output no longer verifies (deleted or altered); rerunning")
        force = skip_cache = True
    elif cached == "unsafe":  # not read; the committed checkpoint of the same identity still counts
        logger.warning(f"{st.spec.name}: the cached result under {run.key} is not a JSON record (a pickle?); "
                       "moved aside unread (.refused)")
        skip_cache = True
    return (run_stage_on_pool if st.spec.work_pool else run_stage).with_options(
        name=f"stage-{st.spec.stage}",
        task_run_name=st.spec.name,
        retries=st.spec.retries,
        retry_delay_seconds=st.spec.retry_delay_seconds,
        # Prefect's own deadline is a backstop: the stage's subprocess tree is ended by the launcher first
        timeout_seconds=st.spec.timeout_s + 60 if st.spec.timeout_s else None,
        refresh_cache=skip_cache or None,
    ), force


class Scheduler:
    """Runs the stage tasks, one at a time (``limit`` 1: each called directly) or up to ``limit`` at once (submitted
    as their inputs finish). ``keep_going``: a failed stage is recorded in ``failed`` (name -> its one-line error)
    instead of raised."""

    def __init__(self, limit: int, outputs: dict[str, Any], failed: dict[str, str], keep_going: bool):
        self.limit, self.outputs, self.failed, self.keep_going = limit, outputs, failed, keep_going
        self.running: dict[str, Any] = {}  # stage name -> its task's future

    def start(self, name: str, task, args: tuple, kwargs: dict) -> None:
        if self.limit == 1:
            self._settle(name, lambda: task(*args, **kwargs))
            return
        import concurrent.futures

        while len(self.running) >= self.limit:  # wait for one to finish
            concurrent.futures.wait([f.wrapped_future for f in self.running.values()], return_when=concurrent.futures.FIRST_COMPLETED)
            self.wait_for([n for n, f in self.running.items() if f.wrapped_future.done()])
        self.running[name] = task.submit(*args, **kwargs)

    def wait_for(self, names: list[str]) -> None:
        for name in names:
            if name in self.running:
                self._settle(name, self.running.pop(name).result)  # a failed stage raises here, as a direct call would

    def _settle(self, name: str, result) -> None:
        try:
            self.outputs[name] = result()
        except Exception as e:
            if not self.keep_going:
                raise
            self.failed[name] = str(e)
            get_run_logger().error(f"{name}: failed; the sweep's other variants run on ({e})")


def report_key(name: str) -> str:
    return prefect_key(f"eval-report-{name}")


def _publish_report(name: str, report: EvalReport) -> None:
    """The eval report in the UI: its table and its plot inside the markdown (a data URI: no file to reach)."""
    md = Path(report.markdown).read_text()
    create_markdown_artifact(
        markdown=f"{md}\n![metrics per stage]({data_uri(Path(report.plot).read_bytes())})\n\nFiles: `{report.folder}`",
        key=report_key(name),
        description=f"held-out eval ({name})",
    )


def _publish_summary(pipeline: str, outputs: dict[str, CheckpointRef | EvalReport], runs: dict[str, StageRun],
                     gated: list | None = None, result: str | None = None) -> None:
    """The flow's last artifact: each stage's run folder (a link; ``checkpoint/`` in it holds the output),
    checkpoint kind and digest, and its report (its curves artifact or the eval report); then the gates and the
    pipeline's result (only when every gate passed)."""
    ids = _artifact_ids()

    def report(key: str) -> str:  # this run's artifact; a cached stage's curves: the key's history
        return f"[{key}](/artifacts/artifact/{ids[key]})" if key in ids else f"[{key}](/artifacts/key/{key})"

    roots = sorted({str(r.run_dir.resolve().parent) for r in runs.values()})
    lines = [f"### {pipeline}: {len(outputs)} stages", "", f"Run folders under `{'`, `'.join(roots)}`; each stage's output in its `checkpoint/`.", "",
             "| stage | kind | run folder | digest | report |", "|---|---|---|---|---|"]
    for name, out in outputs.items():
        folder = runs[name].run_dir.resolve()
        link = f"[{folder.name}]({folder.as_uri()})"
        if isinstance(out, EvalReport):
            lines.append(f"| {name} | eval | {link} | - | {report(report_key(name))} |")
            continue
        has_curves = (runs[name].run_dir / "metrics.jsonl").is_file()
        lines.append(f"| {name} | {out.kind} | {link} | `{out.digest[:16]}` | {report(artifact_key(name)) if has_curves else '-'} |")
    if gated:
        lines += ["", f"**Gates**: {sum(r.passed for r in gated)} of {len(gated)} passed", "", gates.report(gated)]
        lines += ["", f"**Result**: stage `{result}`, `{outputs[result].path}`" if result else "**No result**: a gate failed"]
    create_markdown_artifact(markdown="\n".join(lines) + "\n", key="pipeline-summary",
                             description=f"{pipeline}: each stage's run folder, checkpoint digest and report")


def _artifact_ids() -> dict[str, Any]:
    """{key: id} of the artifacts this flow run (and its task runs) published."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.context import get_run_context

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[get_run_context().flow_run.id])))
    return {a.key: a.id for a in arts if a.key}


def parse_sets(items: list[str]) -> dict[str, dict[str, Any]]:
    """``--set STAGE.KEY=VALUE`` items as {stage: {key: value}} (values read as YAML)."""
    import yaml

    overrides: dict[str, dict[str, Any]] = {}
    for item in items:
        key, _, raw = item.partition("=")
        stage, _, field = key.partition(".")
        if not field or "=" not in item:
            raise RecipeError(f"--set {item!r}: expected STAGE.KEY=VALUE (e.g. --set sft.train.max_steps=20)")
        overrides.setdefault(stage, {})[field] = yaml.safe_load(raw)
    return overrides


def _arguments(argv: list[str] | None):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flows.full_rlhf", description=__doc__.split("\n")[0])
    ap.add_argument("pipeline", nargs="?", default=DEFAULT_PIPELINE)
    ap.add_argument("--refresh", default="", help="comma-separated stage names to rerun even if cached")
    ap.add_argument("--output-root", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                    help="override a stage's config, e.g. --set sft.train.max_steps=20")
    ap.add_argument("--cluster", default=None, metavar="ADDRESS",
                    help="run every training stage on the existing Ray cluster at ADDRESS (auto, host:port, ray://host:port)")
    ap.add_argument("--debug", action="store_true", help=f"show tracebacks (also {DEBUG_ENV}=1)")
    ap.add_argument("--verbose", action="store_true", help="every stage's whole output on the console (vLLM, Ray, DeepSpeed); "
                    "without it, in <run folder>/task/stage.log (also RLHF_VERBOSE=1 or LOG_LEVEL=DEBUG)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import json

    args = _arguments(argv)
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    debug = args.debug or take_debug([])
    refresh = [s for s in args.refresh.split(",") if s]
    with one_line_errors(PROG, debug):
        overrides = parse_sets(args.set)
        os.chdir(PROJECT_ROOT)
        # the whole recipe (every stage's config, inputs and files) is checked before Prefect's server starts
        p = plan(args.pipeline, output_root=args.output_root, stage_overrides=overrides or None, cluster_address=args.cluster)
        check_refresh(p, refresh, args.pipeline)
    # Prefect's temporary server (and anything else this process starts) ends with it, even on SIGKILL
    from stages.common.reaper import start as start_reaper

    start_reaper(os.getpid())
    try:
        summary = full_rlhf(args.pipeline, overrides or None, refresh, args.output_root, args.cluster)
    except Exception as e:
        if debug:
            raise
        # the stage's traceback is in the log above, once; the last line says which stage failed and why
        print(f"{PROG}: {e if isinstance(e, StageError | gates.GateFailed) else f'{type(e).__name__}: {e}'}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "metrics"} if isinstance(v, dict) else v
                      for k, v in summary.items()}, indent=2))


if __name__ == "__main__":
    main()
