"""Script 06: publish the audited stage to the Hub as one commit, then verify what landed.

``start`` holds :func:`publish`: its checks, the stage lock, and the audit, which it starts on
its own thread before the Hub client is even imported; ``audited`` what the audit hands on
(the files, the stat snapshot) to the steps after it; ``commit`` narrates the rest step by
step (the plan, the one commit, verification, receipt); ``landing`` sends that one
``create_commit``, retries it, and finds out whether it landed when its answer is lost;
``plan`` holds what a publish is asked to do (:class:`Publication`) and what it would do;
``deadline`` bounds the whole publish by ``--timeout``; ``client`` translates the Hub's answers
and retries the idempotent requests; ``xet`` holds everything about the Xet protocol;
``verify`` checks the landed commit against the audit and writes the receipt. Nothing here
imports torch: publishing runs on a machine that never trained.

Names are imported on first use (module ``__getattr__``), as in :mod:`pipeline`: importing
:func:`publish` and :class:`Publication` does not load the Hub client, which loads while the
audit reads.
"""

from __future__ import annotations

from ..lazy import lazy_names

# public name -> module that defines it
_API = {
    "COMMIT_ATTEMPTS": ".landing",
    "REQUEST_TIMEOUT_S": ".deadline",
    "Publication": ".plan",
    "PublishPlan": ".plan",
    "PublishResult": ".commit",
    "default_timeout": ".deadline",
    "format_plan": ".plan",
    "publish": ".start",
}

__all__ = sorted(_API)


__getattr__ = lazy_names(__name__, _API)


def __dir__() -> list[str]:
    return sorted(__all__)
