"""``specdraft bench``: measure every requested method on the same prompts, in one process.

Loop order: method -> dataset -> temperature -> batch size, with our plain decoding
(``none``) always measured first and ``hf-ar`` next, so that every later row has both
references; or, with ``interleave``, setting -> repeat -> batch -> method (every method's
batch i before any method's batch i + 1; with ``lockstep`` their decode steps in turn
within batch i). A row (``rows.RowMeasure``) is all prompts x all
repeats of one method in one setting;
results.json is rewritten (atomically) as soon as a row finishes, and ``--resume``
skips rows that are already there.
"""

from __future__ import annotations

import gc
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SpecdraftError
from ..sampling import SamplingParams
from . import metrics
from .datasets import BenchPrompt, dataset_label, encode_first_turns, load_prompts, second_turn_ids
from .methods import Method
from .rows import RowMeasure
from .specs import build_method, split_shape
from .store import RESULTS, load_for_resume, row_key, write_json_atomic

AR, HF_AR = "none", "hf-ar"


ADAPTIVE_CHOICES = ("on", "off", "refresh")


@dataclass
class BenchConfig:
    """Everything a benchmark run is parameterised by (the CLI's options)."""

    out: Path
    drafters: list[str] = field(default_factory=lambda: ["none", "auto"])
    datasets: list[str] = field(default_factory=lambda: ["mt-bench"])
    target: str = "default"
    device: str = "cpu"
    dtype: str | None = None  # None or "auto": models.resolve_dtype's choice for the device
    trust_remote_code: bool = False
    limit: int | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_p: float = 1.0
    top_k: int = 0
    repeats: int = 1
    max_new_tokens: int = 128
    beam_width: int | None = None
    beam_length: int | None = None
    gamma: int | None = None
    seed: int = 0
    chat: bool = True
    mt_bench_turns: int = 1
    resume: bool = False
    warmup: bool = True
    progress: bool = True
    command: str = ""
    adaptive: str = "on"  # on | off (fixed shapes) | refresh (re-measure the cost model first)
    interleave: bool = False  # every method loaded at once, their batches in turn (see Bench.run_interleaved)
    lockstep: bool = False  # interleave, and our methods' batches advance a decode step each in turn
    compile_target: bool = False  # our methods run the target's decoder stack compiled (peers: eager)
    tree_attention: str = "fast"  # Target.tree_attention of our methods' target
    # Every row writes max_new_tokens (an EOS does not end it): throughput at a fixed length,
    # so that methods whose text differs (bfloat16 near-ties) still do the same amount of work.
    ignore_eos: bool = False

    def resolved_dtype(self) -> str:
        from ..models import resolve_dtype

        return resolve_dtype(self.dtype or "auto", self.device)

    def settings(self) -> dict:
        """What every row of one results.json shares; --resume refuses a mismatch."""
        keys = ("target", "device", "limit", "top_p", "top_k", "repeats", "max_new_tokens", "beam_width",
                "beam_length", "gamma", "seed", "chat", "mt_bench_turns", "adaptive")
        s = {k: getattr(self, k) for k in keys}
        for flag in ("compile_target", "ignore_eos"):  # only when set: earlier results.json still resume
            if getattr(self, flag):
                s[flag] = True
        if self.tree_attention != "fast":  # likewise
            s["tree_attention"] = self.tree_attention
        s["dtype"] = self.resolved_dtype()
        return json.loads(json.dumps(s))

    def method_order(self) -> list[str]:
        """none first (always measured: every speed-up needs it), hf-ar next, then the rest."""
        asked = list(dict.fromkeys(self.drafters))
        head = [AR] + ([HF_AR] if HF_AR in asked else [])
        return head + [d for d in asked if d not in head]

    def validate(self) -> None:
        from .specs import check_spec

        for name, values in (("--drafters", self.drafters), ("--dataset", self.datasets),
                             ("--batch-sizes", self.batch_sizes), ("--temperatures", self.temperatures)):
            if not values:
                raise SpecdraftError(f"{name} is empty")
        for spec in self.drafters:
            check_spec(spec)
        if self.repeats < 1:
            raise SpecdraftError(f"--repeats must be >= 1, got {self.repeats}")
        if self.adaptive not in ADAPTIVE_CHOICES:
            raise SpecdraftError(f"--adaptive must be one of {', '.join(ADAPTIVE_CHOICES)}, got {self.adaptive!r}")
        if self.limit is not None and self.limit < 1:
            raise SpecdraftError(f"--limit must be >= 1, got {self.limit}")
        if any(b < 1 for b in self.batch_sizes):
            raise SpecdraftError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        for t in self.temperatures:
            SamplingParams(max_new_tokens=self.max_new_tokens, temperature=t, top_p=self.top_p,
                           top_k=self.top_k).validate()


def environment(target, cfg: BenchConfig) -> dict:
    """Where and with what the numbers were measured."""
    import transformers

    from .. import __version__, fastpath, siblings
    from ..models import parameter_count

    dev = target.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return {"specdraft": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "device": str(dev),
            "device_name": name, "threads": torch.get_num_threads(),
            "dtype": str(target.dtype).removeprefix("torch."), "compiled_target": bool(getattr(target, "compiled", False)),
            "target": target.name, "target_params": parameter_count(target.model),
            # the few-row kernels this process chose (a start-up timing decides) and what they stack
            "linear_layout": fastpath.layout_name(target.dtype), "stacked_groups": siblings.stacked_groups(target.model),
            "tree_attention": getattr(target, "tree_attention", "fast")}


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Bench:
    """One benchmark run: the loaded target, its methods, and the results so far."""

    def __init__(self, cfg: BenchConfig, target=None):
        from ..models import load_target, quiet_loading

        cfg.validate()
        self.cfg = cfg
        if target is None:
            with quiet_loading():
                target = load_target(cfg.target, cfg.device, cfg.resolved_dtype(), cfg.trust_remote_code,
                                     cfg.tree_attention)
        target.check_new_tokens(cfg.max_new_tokens)
        if cfg.compile_target and not target.compiled:
            from ..build import compile_target
            from .specs import feature_layers

            # minutes, untimed; peers keep the eager model (target.model)
            compile_target(target, layers=feature_layers(cfg.drafters, target))
            target.warmed()
        self.target = target
        self.datasets: dict[str, tuple] = {}  # spec -> (prompts, first-turn ids)
        self.turn2: dict[tuple, list[int]] = {}  # (method, dataset, prompt index) -> turn-2 prompt ids
        self.memory = metrics.PeakMemory(self.target.device)
        previous = load_for_resume(cfg.out, cfg.settings()) if cfg.resume else None
        self.results = previous or {"settings": cfg.settings(), "runs": []}
        self.results.update(environment=environment(self.target, cfg), command=cfg.command,
                            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        self.done = {row_key(r) for r in self.results["runs"]}
        self.cost = None  # the target's cost model, loaded at the first adaptive method

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> dict:
        """Measure every missing row; results.json is current after each.

        Methods are the outer loop: each is loaded once, measured in every setting, and
        released before the next, so its peak memory holds only the target and itself.
        With ``interleave`` every method is loaded at once and settings are the outer loop."""
        if self.cfg.interleave or self.cfg.lockstep:
            return self.run_interleaved()
        cfg = self.cfg
        for name in cfg.method_order():
            todo = [s for s in self.settings() if (name, *s[1:]) not in self.done]
            if not todo:
                continue
            method = self.build(name, self.prompts(todo[0][0])[1][0])
            for spec, label, temperature, batch_size in todo:
                row = self.start_rows({name: method}, spec, temperature, batch_size)[name]
                starts = [] if row.reason else row.starts
                with progress_bar(len(starts) * cfg.repeats, f"{label} T={temperature:g} B={batch_size} {name}",
                                  cfg.progress) as bar:
                    for _ in range(cfg.repeats):
                        for start in starts:
                            row.batch(start)
                            bar.update(1)
                        row.end_repeat()
                self.add(row.finish(self.memory.read(), self.target))
            del method
            self.release()
        return self.results

    def run_interleaved(self) -> dict:
        """Every method loaded at once; within each setting and repeat, batch i of every
        method runs before batch i + 1 of any (the method order rotating from batch to
        batch), so a machine whose speed drifts (a shared VM, another job) slows every method
        alike and the ratios between them stay honest. Peak memory is then the process's."""
        cfg = self.cfg
        names = [n for n in cfg.method_order() if any((n, *s[1:]) not in self.done for s in self.settings())]
        if not names:
            return self.results
        methods = {n: self.build(n, self.prompts(cfg.datasets[0])[1][0]) for n in names}
        for spec, _, temperature, batch_size in self.settings():
            todo = {n: m for n, m in methods.items() if (n, dataset_label(spec), temperature, batch_size) not in self.done}
            if not todo:
                continue
            rows = self.start_rows(todo, spec, temperature, batch_size)
            measured = [r for r in rows.values() if not r.reason]
            starts = measured[0].starts if measured else []
            with progress_bar(len(starts) * len(measured) * cfg.repeats,
                              f"{dataset_label(spec)} T={temperature:g} B={batch_size} ({len(measured)} methods)",
                              cfg.progress) as bar:
                for _ in range(cfg.repeats):
                    for i, start in enumerate(starts):
                        order = measured[i % len(measured):] + measured[:i % len(measured)]
                        if cfg.lockstep:
                            run_lockstep(order, start)
                        else:
                            for row in order:
                                row.batch(start)
                        bar.update(len(order))
                    for row in rows.values():
                        row.end_repeat()
            memory = self.memory.read()
            for row in rows.values():
                self.add(row.finish({**memory, "memory_peak_is_per_row": False}, self.target))
        return self.results

    def settings(self) -> list[tuple]:
        """(dataset spec, dataset label, temperature, batch size) of every setting."""
        cfg = self.cfg
        return [(spec, dataset_label(spec), float(t), int(b)) for spec in cfg.datasets for t in cfg.temperatures
                for b in cfg.batch_sizes]

    def start_rows(self, methods: dict, spec: str, temperature: float, batch_size: int) -> dict:
        """A RowMeasure per method for one setting (peak memory counted from here)."""
        items, first = self.prompts(spec)
        rows = {}
        for name, method in methods.items():
            measurable = method.unsupported(batch_size) is None
            prompts = self.prompt_ids(method, spec, items, first) if measurable else first
            rows[name] = RowMeasure(method, spec, items, prompts, temperature, batch_size, self.cfg)
        self.memory.reset()
        return rows

    def prompts(self, spec: str) -> tuple[list[BenchPrompt], list[list[int]]]:
        """A dataset's prompts and their first-turn token ids (loaded once)."""
        if spec not in self.datasets:
            items = load_prompts(spec, self.cfg.limit, self.cfg.chat, self.cfg.mt_bench_turns)
            self.datasets[spec] = (items, encode_first_turns(self.target, items, self.cfg.chat))
        return self.datasets[spec]

    def build(self, spec: str, warm_prompt: list[int]) -> Method:
        """The method named ``spec``, built and warmed up (untimed)."""
        from ..models import quiet_loading

        cfg = self.cfg
        base, shape = split_shape(spec)
        # @fixed / @adaptive override --adaptive; plain decoding has nothing to adapt.
        adaptive = shape.get("adaptive", cfg.adaptive != "off") and base != AR
        with quiet_loading():
            method = build_method(spec, self.target, cfg.beam_width, cfg.beam_length, cfg.gamma,
                                  self.policy() if adaptive else None)
        if cfg.warmup:  # first calls pay for allocations and kernel selection
            method.generate([warm_prompt], [SamplingParams(max_new_tokens=min(8, cfg.max_new_tokens))])
        return method

    def policy(self):
        """A fresh adaptive policy (the cost model measured or read once per run)."""
        from ..adaptive import AdaptivePolicy
        from ..costmodel import load_cost_model

        if self.cost is None:
            self.cost = load_cost_model(self.target, refresh=self.cfg.adaptive == "refresh")
        return AdaptivePolicy(self.cost)

    def release(self) -> None:
        """Free what the last method held (its draft model, its turn-2 prompts)."""
        self.turn2.clear()
        gc.collect()
        if self.target.device.type == "cuda":
            torch.cuda.empty_cache()

    def prompt_ids(self, method: Method, spec: str, items: list[BenchPrompt], first: list[list[int]]):
        """The measured prompts: first turns, or (MT-Bench turn 2) the conversation with
        this method's own greedy answer to the first turn (generated once, untimed)."""
        if not any(it.follow_up for it in items):
            return first
        ids = []
        for i, (item, prompt) in enumerate(zip(items, first)):
            key = (method.spec, spec, i)
            if key not in self.turn2:
                answer = method.generate([prompt], [SamplingParams(max_new_tokens=self.cfg.max_new_tokens)])
                self.turn2[key] = second_turn_ids(self.target, item, answer.prompts[0].text)
            ids.append(self.turn2[key])
        return ids

    def add(self, row: dict) -> None:
        """Keep a finished row, refresh the speed-ups, and save."""
        self.results["runs"].append(row)
        self.done.add(row_key(row))
        derive_speedups(self.results["runs"])
        write_json_atomic(Path(self.cfg.out) / RESULTS, self.results)

def run_lockstep(rows: list[RowMeasure], start: int) -> None:
    """Batch ``start`` of every row: transformers' peers whole (they cannot step), then our
    methods' batches one decode step each in turn, the order rotating every round, so that
    a swing of the machine's speed lands on every method's steps alike (``methods.Stepping``:
    each batch counts its own steps' time only)."""
    stepping = []
    for row in rows:
        batch = row.begin(start)
        if batch is None:
            row.batch(start)
        else:
            stepping.append((row, batch))
    turn = 0
    while alive := [batch for _, batch in stepping if not batch.done]:
        for batch in alive[turn % len(alive):] + alive[:turn % len(alive)]:
            batch.advance()
        turn += 1
    for row, batch in stepping:
        row.record(start, batch.outcome())


def derive_speedups(runs: list[dict]) -> None:
    """speedup_vs_ar / speedup_vs_hf_ar of every row: its median tokens/s over that of
    ``none`` / ``hf-ar`` in the same (dataset, temperature, batch size)."""
    settings: dict[tuple, dict[str, dict]] = {}
    for row in runs:
        settings.setdefault(row_key(row)[1:], {})[row["drafter"]] = row
    for rows in settings.values():
        ar, hf = rows.get(AR, {}), rows.get(HF_AR, {})
        for row in rows.values():
            rate = row.get("tokens_per_second")
            row["speedup_vs_ar"] = metrics.speedup(rate, ar.get("tokens_per_second"))
            row["speedup_vs_hf_ar"] = metrics.speedup(rate, hf.get("tokens_per_second"))


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr (a no-op when disabled)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="batch", disable=not enabled, file=sys.stderr, leave=True)


def run_bench(cfg: BenchConfig, target=None) -> dict:
    """Measure, then write report.md and the plots; a Ctrl-C still leaves a report of
    the rows that finished."""
    from .report import write_report

    bench = Bench(cfg, target)
    try:
        bench.run()
    finally:
        if bench.results["runs"]:
            write_report(bench.results, Path(cfg.out))
    return bench.results

