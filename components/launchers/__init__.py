"""The launch backends. Both implement one function with the same shape:

    launch(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult

``components.launch`` picks the backend from ``config.launch.backend``; nothing else differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LaunchResult:
    """How a training launch ended, already mapped to the exit-code contract."""

    exit_code: int
    message: str = ""
    restarts: int = 0
    resumed_from_steps: list[int] = field(default_factory=list)
    duration_seconds: float = 0.0
    job_name: str | None = None
