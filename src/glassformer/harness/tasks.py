"""What `glassformer eval --tasks` runs: harness tasks (names or YAML files) on a GlassformerLM,
the harness's table, and one JSON line with each task's accuracy beside its chance level.

Small models sit at chance on most benchmarks, so the line carries acc_centered = (acc - c) / (1 - c),
c the mean over documents of 1 / number of choices: 0 is chance, 1 every answer right.

    >>> centered(0.5, 0.05, 0.25)
    (0.333333, 0.066667)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UserError

YAML = (".yaml", ".yml")
SEED_DEFAULTS = (0, 1234, 1234, 1234)  # the harness's own: python, numpy, torch, few-shot sampling


def centered(acc: float, stderr: float | None, chance: float) -> tuple[float, float | None]:
    """(acc - chance) / (1 - chance) and its standard error, rounded to 6 places."""
    scale = 1.0 - chance
    return round((acc - chance) / scale, 6), None if stderr is None else round(stderr / scale, 6)


def chance_level(samples: list[dict]) -> float | None:
    """Mean over documents of 1 / (number of choices), from the harness's logged samples; None
    for a task with no choices. A mutual-information task asks each choice twice."""
    per_doc = {}
    for s in samples:
        n = len(s["arguments"]) // (2 if "acc_mutual_info" in s.get("metrics", ()) else 1)
        per_doc[s["doc_id"]] = 1.0 / n if n else None
    values = list(per_doc.values())
    return None if not values or None in values else sum(values) / len(values)


def _number(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def task_line(metrics: dict, output_type: str | None, samples: list[dict] | None) -> dict:
    """One task's entry of the JSON line: acc, acc_stderr, acc_norm (when there), chance, acc_centered
    and its stderr for a task scored by accuracy over choices; the harness's own metrics otherwise."""
    plain = {k.split(",")[0] if k.endswith(",none") else k: _number(v) for k, v in metrics.items() if k != "alias"}
    plain = {k: v for k, v in plain.items() if v is not None or k.endswith("_stderr")}
    if "acc" not in plain:
        return plain
    line = {"acc": plain["acc"], "acc_stderr": plain.get("acc_stderr")}
    if "acc_norm" in plain:
        line["acc_norm"] = plain["acc_norm"]
    c = chance_level(samples) if output_type == "multiple_choice" and samples else None
    line["chance"] = None if c is None else round(c, 6)
    line["acc_centered"], line["acc_centered_stderr"] = (None, None) if c is None or c >= 1 else \
        centered(line["acc"], line["acc_stderr"], c)
    return line


def summary(results: dict, limit, num_fewshot) -> dict:
    """The last line of `glassformer eval --tasks`: {"tasks": {name: ...}, "limit", "num_fewshot"}."""
    samples, configs = results.get("samples") or {}, results.get("configs") or {}
    tasks = {name: task_line(m, configs.get(name, {}).get("output_type"), samples.get(name))
             for name, m in results["results"].items()}
    return {"tasks": tasks, "limit": limit, "num_fewshot": num_fewshot}


def resolve_tasks(names: list[str], include: list[str]):
    """(the harness's TaskManager over --include-path folders, the tasks to run: names as given,
    YAML files as their configs). A YAML's `!function` entries import and run its Python code."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    for d in include:
        if not Path(d).is_dir():
            raise UserError(f"--include-path {d} is not a folder of task YAML files")
    paths = [str(Path(d).resolve()) for d in include] or None
    # The harness's own index of its hundreds of task folders takes half a minute to build:
    # only when a name is not a YAML file or in the --include-path folders.
    manager = TaskManager(include_path=paths, include_defaults=False)
    if not all(n.endswith(YAML) or manager.match_tasks([n]) for n in names):
        manager = TaskManager(include_path=paths)
    tasks = []
    for name in names:
        if name.endswith(YAML):
            if not Path(name).is_file():
                raise UserError(f"task file {name} does not exist")
            tasks.append(load_yaml(str(Path(name).resolve()), resolve_func=True))
        elif manager.match_tasks([name]):
            tasks.append(name)
        else:
            raise UserError(f"unknown task {name!r}: give a harness task name (lm-eval ls tasks), "
                            "a task YAML file, or the folder that holds it with --include-path")
    return manager, tasks


def evaluate(lm, names: list[str], include: list[str], *, limit=None, num_fewshot=None, seed=None) -> dict:
    """The harness's simple_evaluate of `lm` on the tasks; a missing offline dataset is a UserError."""
    from lm_eval import simple_evaluate

    manager, tasks = resolve_tasks(names, include)
    seeds = SEED_DEFAULTS if seed is None else (seed,) * 4
    try:
        return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                               log_samples=True, random_seed=seeds[0], numpy_random_seed=seeds[1],
                               torch_random_seed=seeds[2], fewshot_random_seed=seeds[3])
    except ConnectionError as e:  # datasets' "Couldn't reach ... on the Hub (OfflineModeIsEnabled)"
        offline = os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE")
        raise UserError(f"a task's dataset is not in the Hugging Face cache and cannot be fetched ({e}): "
                        + ("unset HF_DATASETS_OFFLINE (and HF_HUB_OFFLINE) and run once online to cache it"
                           if offline else "check the network, or cache it first and set HF_DATASETS_OFFLINE=1")
                        ) from None


def write_results(folder: str, results: dict) -> Path:
    """The harness's results (without the logged samples) as DIR/results.json, written atomically."""
    from lm_eval.utils import handle_non_serializable

    from ..files import atomic_text

    path = Path(folder) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {k: v for k, v in results.items() if k != "samples"}
    atomic_text(path, json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    return path


def run_tasks(args, model, tokenizer) -> int:
    """`glassformer eval --tasks`: the table on stdout, then the summary as the last line."""
    from lm_eval.utils import make_table

    from .lm import GlassformerLM

    if tokenizer is None:
        raise UserError(f"{args.checkpoint} has no tokenizer.json: the harness gives text, so the model needs its tokenizer")
    lm = GlassformerLM(model=model, tokenizer=tokenizer, batch_size=args.batch_size)
    names = [t for t in args.tasks.split(",") if t]
    results = evaluate(lm, names, args.include_path or [], limit=args.limit, num_fewshot=args.num_fewshot,
                       seed=args.seed)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output_path:
        print(f"results: {write_results(args.output_path, results)}")
    print(json.dumps(summary(results, args.limit, args.num_fewshot)))
    return 0
