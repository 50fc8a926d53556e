"""What a run is checked for in one process before any other starts (``check_run``), so a
mistake every rank would fail on in unison is one error: the schedule, the model's split, the
data, the output folders and the checkpoint to resume."""

from __future__ import annotations

from pipeoffload.errors import ConfigError
from pipeoffload.offload.plan import OffloadPlan
from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.checkpoint_files import check_root, resolve_resume
from pipeoffload.parallel.checkpoint_lock import check_unlocked
from pipeoffload.parallel.export import check_export_folder
from pipeoffload.training.data import TextDataset
from pipeoffload.training.hf_run import check_model
from pipeoffload.training.train import TrainConfig, build_plan
from pipeoffload.training.trainer import checkpoint_identity


def check_run(config: TrainConfig, processes: int) -> OffloadPlan:
    """Check what every rank would otherwise fail on in unison (``processes``: how many will
    run; a checkpoint counts them without context parallelism, whose ranks hold the same
    state, so a run resumes with another ``cp``); returns the plan the run will use."""
    plan = build_plan(config)
    if plan.schedule.routes:
        raise ConfigError(f"--schedule {config.schedule}: its microbatches take several routes "
                          "whose stages share weights (DualPipe's two copies), which train does "
                          "not tie or all-reduce; use dualpipev (one copy, the same order folded "
                          "into V placement)")
    check_model(config, plan.schedule.num_stages)
    if config.model.document_eos is not None and config.tp > 1:
        raise ConfigError("--document-mask with --tp above 1 is not supported yet; use --tp 1")
    dataset = TextDataset.from_config(config.data, dp_size=config.dp)
    if config.checkpoint_dir is not None:
        check_root(config.checkpoint_dir)
        check_unlocked(config.checkpoint_dir)
    if config.export_hf is not None:
        check_export_folder(config.export_hf)
    resume = resolve_resume(config.resume, config.checkpoint_dir)
    if resume is not None:
        manifest = ckpt.read_manifest(ckpt.find_checkpoint(resume, config.checkpoint_dir))
        ckpt.check_compatible(manifest, {**checkpoint_identity(config, plan.schedule),
                                         "processes": processes // config.cp})
        ckpt.check_resume_step(manifest.step, manifest.folder, config.steps)
        saved = manifest.info.get("data")
        if isinstance(saved, dict):
            dataset.load_state_dict(saved)  # the same data and batching, or refused here
    elif config.checkpoint_dir is not None and ckpt.complete_checkpoints(config.checkpoint_dir):
        raise ConfigError(f"--checkpoint-dir {config.checkpoint_dir} already holds checkpoints; "
                          "pass --resume to continue from them, or use an empty folder")
    return plan
