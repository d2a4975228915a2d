"""The validation gate, base: the gpufleet marker and the diagnostics every host carries."""
from __future__ import annotations

from pyinfra.facts.files import FileContents

from gpufleet.checks.gate import FAIL, FIX_DEPLOY, MARKER, PASS, SKIP, Context, Result, check
from gpufleet.facts.packages import PackageVersions
from gpufleet.plans.base import plan_base


@check("base")
def marker_matches_tier(ctx: Context) -> Result:
    name = "the gpufleet marker matches the tier"
    lines = ctx.fact(FileContents, path=MARKER)
    expected = plan_base(ctx.settings).marker_lines
    if lines is None:
        return Result("base", name, FAIL, f"{MARKER} is missing (gpufleet never ran here, or it was removed)",
                      FIX_DEPLOY)
    if [line.rstrip() for line in lines] == expected:
        return Result("base", name, PASS, f"tier {ctx.settings.tier}")
    tiers = [line.split(":", 1)[1].strip() for line in lines if line.startswith("tier:")]
    if tiers and tiers[0] != ctx.settings.tier:
        found = f"{MARKER} says tier {tiers[0]}, the inventory says {ctx.settings.tier}"
    else:
        changed = [line for line in lines if line.rstrip() not in expected]
        found = f"{MARKER} was changed by hand" + (f" (unexpected line {changed[0]!r})" if changed else "")
    return Result("base", name, FAIL, found, f"{FIX_DEPLOY} to rewrite it for tier {ctx.settings.tier}")


@check("base")
def diagnostics_installed(ctx: Context) -> Result:
    name = "the tier's diagnostics packages are installed"
    wanted = list(plan_base(ctx.settings).packages)
    if not wanted:
        return Result("base", name, SKIP, "the tier lists none")
    versions = ctx.fact(PackageVersions, packages=wanted)
    missing = [p for p in wanted if not versions.get(p)]
    if missing:
        return Result("base", name, FAIL, f"not installed: {', '.join(missing)}",
                      f"{FIX_DEPLOY} (or apt-get install {' '.join(missing)})")
    return Result("base", name, PASS, f"{len(wanted)} packages")


