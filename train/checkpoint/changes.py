"""What a resume changes that its user may not mean, said in one warning line each: the global
batch (the rank order's is ranks x batch_size x accumulate, so a resume on fewer ranks shrinks
it), and the learning rate moving back up (a cosine schedule stretched by a larger
train.max_steps climbs from its tail). Both from the checkpoint's own config (meta.json) and the
resuming run's, as plain values; nothing is refused."""

from __future__ import annotations

from typing import Any

from ringfeed.train.config import OptimSection
from ringfeed.train.schedule import make_schedule

LR_RISE = 1.01  # a rate more than 1% above the checkpoint config's at the same step is named


def step_batch(global_batch_size: int | None, batch_size: int, world_size: int,
               accumulate: int) -> int:
    """Samples per optimizer step, the one rule (train/feed.py plans with it): the config's
    data.global_batch_size when set (data.order global reads it at any world size; rank order
    settles data.batch_size from it, train/config.py), else ranks x batch_size x accumulate."""
    return global_batch_size or world_size * batch_size * accumulate


def global_batch(config: dict[str, Any], world_size: int) -> int | None:
    """step_batch of a checkpoint's plain config at `world_size`; None when unknown."""
    data, k = config.get("data", {}), config.get("train", {}).get("accumulate", 1)
    batch, fixed = data.get("batch_size"), data.get("global_batch_size")
    if not fixed and not (isinstance(batch, int) and isinstance(k, int)):
        return None
    return step_batch(fixed, batch or 0, world_size, k)


def batch_change(saved: dict[str, Any], saved_world: int, config: dict[str, Any],
                 world: int) -> str | None:
    before, after = global_batch(saved, saved_world), global_batch(config, world)
    if before is None or after is None or before == after:
        return None
    return (f"warning: the global batch changes from {before} samples per step ({saved_world} "
            f"rank(s) when checkpointed) to {after} ({world} now): the steps, the schedule "
            "and the lr scaling follow; set data.global_batch_size to keep it at any world size")


def lr_rise(saved: dict[str, Any], saved_world: int, config: dict[str, Any], world: int,
            step: int) -> str | None:
    """When both configs count steps (train.max_steps; no epoch-based warmup or milestones),
    the checkpoint's rate for the next step against this config's."""
    rates = []
    for cfg, size in ((saved, saved_world), (config, world)):
        optim, train = cfg.get("optim", {}), cfg.get("train", {})
        if not train.get("max_steps") or optim.get("warmup_epochs") or \
                optim.get("schedule") == "multistep":
            return None
        try:
            section = OptimSection(**optim)
        except (TypeError, ValueError):  # (a config of another ringfeed version)
            return None
        schedule = make_schedule(section, size, int(train.get("accumulate", 1)),
                                 int(train["max_steps"]), 1)
        rates.append(schedule(step))
    before, after = rates
    if after <= before * LR_RISE:
        return None
    causes = [f"train.max_steps {saved['train']['max_steps']} -> {config['train']['max_steps']}"
              if saved["train"]["max_steps"] != config["train"]["max_steps"] else "",
              f"{saved_world} -> {world} ranks" if saved_world != world else "",
              "optim changed" if saved.get("optim") != config.get("optim") else ""]
    return (f"warning: the learning rate moves up at this resume: {after:.3g} at step "
            f"{step + 1} where the checkpoint's config gave {before:.3g} "
            f"({', '.join(c for c in causes if c)}); to continue its decay keep the schedule's "
            "settings, or warm up again (optim.warmup_steps)")


def resume_warnings(saved: dict[str, Any], saved_world: int, config: dict[str, Any],
                    world: int, step: int) -> list[str]:
    """The lines for a resume at `step` of a checkpoint written under `saved` on `saved_world`
    ranks, by a run of `config` on `world` ranks."""
    if saved_world < 1:  # (a meta.json without it: nothing to compare)
        return []
    lines = [batch_change(saved, saved_world, config, world),
             lr_rise(saved, saved_world, config, world, step)]
    return [line for line in lines if line is not None]
