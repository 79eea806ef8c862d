"""``verify_checkpoint``, where scripts import it from: the check itself is :mod:`fastpersist_dist.tools.verify`."""

from .tools.verify import VerifyReport, verify_checkpoint

__all__ = ["VerifyReport", "verify_checkpoint"]
