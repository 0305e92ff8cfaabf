"""Spark integration: the ``qstore`` data source, the audit job and the backfill job.

Import of this package does not import pyspark; :func:`get_session` does.
"""

from ._session import DEFAULT_MASTER, get_session, register

__all__ = ["DEFAULT_MASTER", "get_session", "register"]
