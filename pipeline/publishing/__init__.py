"""Script 06: publish the audited stage to the Hub as one commit, then verify what landed.

``commit`` narrates the publish step by step (audit, scan, plan, the one commit, verification,
receipt); ``landing`` sends that one ``create_commit``, retries it, and finds out whether it
landed when its answer is lost; ``plan`` holds what a publish is asked to do
(:class:`Publication`) and what it would do; ``deadline`` bounds the whole publish by
``--timeout``; ``client`` translates the Hub's answers and retries the idempotent requests;
``xet`` holds everything about the Xet protocol; ``verify`` checks the landed commit against
the audit and writes the receipt. Nothing here imports torch: publishing runs on a machine
that never trained.
"""

from .commit import PublishResult, publish
from .deadline import REQUEST_TIMEOUT_S, default_timeout
from .landing import COMMIT_ATTEMPTS
from .plan import Publication, PublishPlan, format_plan

__all__ = [
    "COMMIT_ATTEMPTS",
    "REQUEST_TIMEOUT_S",
    "Publication",
    "PublishPlan",
    "PublishResult",
    "default_timeout",
    "format_plan",
    "publish",
]
