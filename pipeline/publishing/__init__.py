"""Script 06: publish the audited stage to the Hub as one commit, then verify what landed.

``commit`` narrates the publish step by step (audit, scan, plan, the one ``create_commit``,
verification, receipt); ``client`` bounds and translates the Hub requests; ``verify``
checks the landed commit against the audit and writes the receipt. Nothing here imports
torch: publishing runs on a machine that never trained.
"""

from .client import DEFAULT_TIMEOUT_S
from .commit import COMMIT_ATTEMPTS, PublishPlan, PublishResult, format_plan, publish

__all__ = ["COMMIT_ATTEMPTS", "DEFAULT_TIMEOUT_S", "PublishPlan", "PublishResult", "format_plan", "publish"]
