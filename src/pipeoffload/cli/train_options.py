"""`pipeoffload train`'s options: the parser (in groups, with TrainConfig's defaults), the
effective settings of a run, and the flag that sets each TrainConfig field, which names the
field in a configuration error (errors.FieldError)."""

from __future__ import annotations

import argparse
import dataclasses

from pipeoffload.cli import preflight
from pipeoffload.cli.config_file import changed_flags, settings_toml
from pipeoffload.cli.preflight import (
    MAX_CHUNKS,
    MAX_MICROBATCHES,
    MAX_RANKS,
    DefaultOutputFile,
    ModelPath,
    count,
    data_source,
    input_path,
    number,
    output_dir,
    output_file,
    resume_path,
)
from pipeoffload.errors import ConfigError, FieldError
from pipeoffload.training.model_config import MODEL_PRESETS

_SHAPE_FLAGS = {"n_layers": "--layers", "dim": "--dim", "n_heads": "--heads",
                "n_kv_heads": "--kv-heads", "ffn_hidden": "--ffn-hidden"}
# TrainConfig fields set by an option of another name (the rest: the option of the field's
# last name, ``data.seq_len`` by --seq-len). Fields no option sets keep their own names.
_FIELD_DESTS = {"hf_model": "model", "p2p_timeout_s": "p2p_timeout",
                "measure_baseline": "no_baseline"}


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """Every option of `pipeoffload train`, in the order help and settings files show them."""
    parser.add_argument("--config", type=preflight.input_file, default=None, metavar="FILE.toml",
                   help="read settings from a TOML file: any option below without its --, "
                   "e.g. pp = 4, checkpoint-dir = \"ck\"; options on the command line win")
    _parallelism_options(parser)
    _model_and_data_options(parser)
    _optimisation_options(parser)
    _runtime_and_output_options(parser)
    parser.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)


def _parallelism_options(parser: argparse.ArgumentParser) -> None:
    """Pipeline, data and tensor parallelism, the schedule, offload, dtype and recompute."""
    g = parser.add_argument_group("parallelism and schedule")
    g.add_argument("--pp", type=count(1, MAX_RANKS), default=4,
                   help="pipeline ranks (default 4)")
    g.add_argument("--dp", type=count(1, MAX_RANKS), default=1,
                   help="data-parallel pipeline replicas (default 1)")
    g.add_argument("--schedule", default="po-f", help="schedule name (default po-f; "
                   "`pipeoffload schedules` lists them)")
    g.add_argument("--chunks", type=count(1, MAX_CHUNKS), default=None, help="stages per rank")
    g.add_argument("--group-size", type=count(1, MAX_RANKS), default=None,
                   help="grouped-interleaved g")
    g.add_argument("--microbatches", type=count(1, MAX_MICROBATCHES), default=None,
                   help="microbatches per replica and step (default 2 * pp: the default "
                   "batch of 16 then splits evenly up to pp 8; simulate's 4 * pp would not)")
    g.add_argument("--offload", default=None, metavar="SPEC",
                   help="none | all | chunks:K | fraction:X | limit:X | recompute-chunks:1+all "
                   "| classes:A+B[/recompute:C+D] (these tensor classes moved, those "
                   "recomputed; tp 1, cp 1) (po-h/po-f: own default)")
    g.add_argument("--fetch-on-use", action="store_true",
                   help="backward passes read offloaded activations from host memory as they "
                   "use them (FETCH) instead of a whole RELOAD: lower peaks, more reads")
    g.add_argument("--inline", action="store_true",
                   help="run every pipeline rank in this one process (dp must be 1)")
    g.add_argument("--tp", type=count(1, MAX_RANKS), default=1,
                   help="tensor-parallel ranks per stage (torch DTensor; default 1); "
                   "pp * dp * tp processes")
    g.add_argument("--cp", type=count(1, MAX_RANKS), default=1,
                   help="context-parallel ranks: each holds 1/cp of every sequence (chunks i "
                   "and 2cp-1-i), attention all-gathers K and V (default 1); pp * dp * tp * cp "
                   "processes")
    g.add_argument("--rank-order", default="pp,dp,cp,tp", metavar="DIMS",
                   help="the mesh's dimensions in global-rank order, outermost first (default "
                   "pp,dp,cp,tp: tensor-parallel peers neighbours, then context-parallel ones; "
                   "the planner numbers dp,pp,cp,tp)")
    g.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp64"),
                   help="fp32 (default); bf16: bf16 weights and activations, fp32 master "
                   "weights and AdamW state; fp64 for exactness checks")
    g.add_argument("--recompute", default="none", choices=("none", "lgd", "full"),
                   help="none (default); lgd: recompute norm and activation-function outputs "
                   "in each layer's backward; full: recompute every stage's forward")
    g.add_argument("--zero", type=int, default=None, choices=(0, 1, 3),
                   help="optimizer sharding; default 1 when dp * cp > 1, else 0. 0: the whole "
                   "optimizer state on every data-parallel replica; 1: float32 masters and "
                   "AdamW moments sharded over the replicas and context-parallel ranks "
                   "(ZeRO-1; its overlapped gradient buckets are verified on gloo only); "
                   "3: FSDP2, each stage's parameters, gradients and moments sharded over the "
                   "replicas (not with --tp or --cp yet: refused in words)")


def _model_choice(text: str) -> str:
    """argparse type of --model: a preset's name, or a path (preflight.ModelPath)."""
    return text if text.lower() in MODEL_PRESETS else ModelPath(text)


def _model_and_data_options(parser: argparse.ArgumentParser) -> None:
    """The model (a preset with overrides, or a Hugging Face model), the text and held-out data."""
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", type=_model_choice, default="small", metavar="PRESET|PATH",
                   help="reference model preset tiny | small | medium (default small), or a "
                   "Hugging Face config.json (random init) or a folder with one and its "
                   "safetensors weights (loaded: fine-tuning)")
    for field, what in (("n_layers", "transformer layers"), ("dim", "model width"),
                        ("n_heads", "heads"), ("n_kv_heads", "key/value heads"),
                        ("ffn_hidden", "SwiGLU inner width")):
        g.add_argument(_SHAPE_FLAGS[field], dest=field, type=count(1, 1 << 20), default=None,
                       help=f"override the preset's {what}")
    g.add_argument("--seq-len", type=count(1, 1 << 20), default=None,
                   help="tokens per sequence (default min(128, the model's max_seq_len); "
                   "a longer one raises max_seq_len)")
    g.add_argument("--batch-size", type=count(1, 1 << 20), default=16,
                   help="global batch in sequences, "
                   "summed over dp replicas (default 16)")
    g.add_argument("--data", type=data_source, default=None, metavar="PATH",
                   help="text file or folder (.jsonl, .gz, .zst, .parquet read as what they "
                   "are; binary files skipped), a saved datasets folder, hf:NAME[:SPLIT] from "
                   "the local cache, or a pre-tokenised store (pipeoffload tokenize) "
                   "(default: Python standard-library sources)")
    g.add_argument("--max-bytes", type=count(1), default=None,
                   help="read at most this much text (default: all of --data; 1 MiB of the "
                   "built-in corpus)")
    g.add_argument("--text-key", default="text", metavar="KEY",
                   help="the JSON-lines field / Parquet or dataset column holding the text "
                   "(default text)")
    g.add_argument("--cache-dir", type=output_dir, default=None, metavar="DIR",
                   help="where text tokenised with --tokenizer is kept (default "
                   "$PIPEOFFLOAD_CACHE or ~/.cache/pipeoffload)")
    g.add_argument("--tokenizer", type=input_path, default=None, metavar="PATH",
                   help="a local tokenizer.json (or its folder), read with the tokenizers "
                   "package; default: bytes are tokens (the vocabulary must hold 256)")
    g.add_argument("--document-mask", action="store_true",
                   help="mask attention by document: a token attends only to earlier tokens of "
                   "its own document (ended by the data's end-of-document token; the reference "
                   "model)")
    g.add_argument("--eval-fraction", type=number(minimum=0, maximum=0.99), default=0.05,
                   metavar="X", help="hold out X of the tokens as whole documents, drawn by --seed "
                   "(default 0.05; 0: none)")
    g.add_argument("--eval-every", type=count(0), default=0, metavar="N",
                   help="also measure the held-out loss at the start and every N steps "
                   "(default 0: at the end only)")
    g.add_argument("--eval-batches", type=count(1, 1 << 20), default=4, metavar="N",
                   help="held-out batches per measurement (default 4)")


def _optimisation_options(parser: argparse.ArgumentParser) -> None:
    """Steps, the learning-rate schedule, AdamW and clipping, the seed."""
    g = parser.add_argument_group("optimisation")
    # The same defaults as TrainConfig's (a test checks).
    g.add_argument("--steps", type=count(1, 1 << 40), default=60,
                   help="train up to this step, counted from the start of training (a resumed "
                   "run continues up to it; default 60)")
    g.add_argument("--lr", type=number(above=0, maximum=1e6), default=3e-3,
                   help="peak AdamW lr (default 3e-3)")
    g.add_argument("--warmup-steps", type=count(0), default=10,
                   help="linear warm-up from lr/N to lr over the first N steps (default 10)")
    g.add_argument("--decay-steps", type=count(1), default=None,
                   help="cosine decay to 0.1 lr at this step (default: constant after warmup)")
    g.add_argument("--weight-decay", type=number(minimum=0, maximum=1e6), default=0.1,
                   help="AdamW weight decay (default 0.1)")
    g.add_argument("--grad-clip", type=number(minimum=0, maximum=1e30), default=1.0,
                   help="clip the global gradient norm to this (default 1.0; 0: off)")
    g.add_argument("--seed", type=count(0, 2**63 - 1), default=0,
                   help="seed of the weights and of the data order (default 0)")


def _runtime_and_output_options(parser: argparse.ArgumentParser) -> None:
    """Device, threads, timeouts, checkpoints, metrics, exports, pictures and progress lines."""
    g = parser.add_argument_group("runtime, checkpoints and output")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (default): CUDA when available, else CPU with gloo")
    g.add_argument("--threads", type=count(1, 4096), default=1,
                   help="torch threads per process on CPU (default 1: tiny matrices run faster "
                   "on one thread, and processes share the cores)")
    g.add_argument("--p2p-timeout", type=number(above=0, maximum=1e7), default=300.0,
                   metavar="S",
                   help="seconds a rank waits for a peer before failing (default 300)")
    g.add_argument("--min-offload-elements", type=count(0), default=0,
                   help="saved tensors this small stay on the device (default 0: move all)")
    g.add_argument("--checkpoint-dir", type=output_dir, default=None, metavar="DIR",
                   help="save checkpoints here (step_<N> folders; one at the end of the run)")
    g.add_argument("--checkpoint-every", type=count(0), default=0, metavar="N",
                   help="also save every N steps (default 0: only the one at the end, which is "
                   "always saved)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   type=resume_path,
                   help="continue from the newest complete checkpoint in --checkpoint-dir, or "
                   "PATH (a step_<N> folder or a checkpoint folder); --steps must be beyond it; "
                   "--resume auto: the newest one if there is one, else start from scratch")
    g.add_argument("--keep-last", type=count(1), default=None, metavar="N",
                   help="keep only the newest N complete checkpoints (default: keep all)")
    g.add_argument("--metrics", type=output_file(stored=True), default=None, metavar="FILE.jsonl",
                   help="write one JSON line per step: step, loss, lr, grad norm, tokens/s, "
                   "step time, MFU, peak activation and host pool bytes per rank")
    g.add_argument("--tensorboard", type=output_dir, default=None, metavar="DIR",
                   help="write the same as TensorBoard scalars (extra: pipeoffload[tensorboard])")
    g.add_argument("--peak-tflops", type=number(above=0, maximum=1e6), default=None,
                   metavar="T", help="one device's peak TFLOP/s, for MFU (default: the "
                   "datasheet bf16 peak of A100 / H100 / H200 in bf16 runs; else no MFU)")
    g.add_argument("--export-hf", type=output_dir, default=None, metavar="DIR",
                   help="write the trained Hugging Face model to DIR (new or empty) for "
                   "transformers' from_pretrained")
    g.add_argument("--export-dtype", default=None, choices=("fp32", "bf16"),
                   help="dtype of --export-hf (default: bf16 for a bf16 run, else fp32)")
    g.add_argument("--no-baseline", action="store_true",
                   help="skip the extra step that measures peaks without offload")
    g.add_argument("--json", action="store_true", help="print one JSON line at the end")
    g.add_argument("--png", default=DefaultOutputFile("pipeoffload-train.png"), metavar="FILE",
                   type=output_file(".png", ".svg", off="--no-png"),
                   help="schedule picture to write, .png or .svg (default pipeoffload-train.png;"
                   " skipped with a note without matplotlib)")
    g.add_argument("--no-png", dest="png", action="store_const", const=None,
                   help="write no picture")
    preflight.add_fifo_wait(g)
    g.add_argument("--log-every", type=count(1), default=10, metavar="N",
                   help="print a progress line every N steps (default 10)")


def train_parser() -> argparse.ArgumentParser:
    """A stand-alone parser of `pipeoffload train`'s options (for its settings files)."""
    root = argparse.ArgumentParser(prog="pipeoffload")
    parser = root.add_subparsers(dest="command").add_parser("train")
    add_train_options(parser)
    return parser


def run_settings(args: argparse.Namespace) -> tuple[str, str]:
    """The effective settings (command line and --config merged): as a TOML file that
    --config reads back, and as the flags that differ from the defaults."""
    parser = train_parser()
    header = ("pipeoffload train: the effective settings of this run (command line and --config "
              "merged);\n`pipeoffload train --config THIS_FILE` runs it again")
    return settings_toml(parser, args, header), changed_flags(parser, args)


def field_flags() -> dict[str, str]:
    """The option that sets each TrainConfig field (``data.*`` and ``model.*`` ones by their
    dotted path), as a FieldError names it; a field no option sets is absent."""
    from pipeoffload.training.train import TrainConfig  # the planner: not for other commands

    options = {action.dest: action.option_strings[0] for action in train_parser()._actions
               if action.option_strings and action.help != argparse.SUPPRESS}
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    fields += [f"model.{name}" for name in _SHAPE_FLAGS]
    fields += [f"data.{name}" for name in ("seq_len", "batch_size")]
    flags = {}
    for name in fields:
        dest = _FIELD_DESTS.get(name, name.rpartition(".")[2])
        if dest in options and name not in ("model", "data"):
            flags[name] = options[dest]
    return flags


def config_error(error: FieldError) -> ConfigError:
    """``error`` as the command line says it: each field named by its option (a field no
    option sets by its own name)."""
    flags = field_flags()
    return ConfigError(error.render({name: flags.get(name, name) for name in error.fields}))
