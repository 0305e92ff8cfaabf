"""Building a SparkSession for qstore's jobs: local mode by default, any master by name."""

from __future__ import annotations

import os
import sys
from importlib import resources
from typing import Any

DEFAULT_MASTER = "local[2]"


def get_session(master: str | None = None, app_name: str = "qstore", *,
                fast_start: bool = False, extra: dict[str, str] | None = None) -> Any:
    """A SparkSession with the ``qstore`` data source registered.

    ``master`` defaults to ``$QSTORE_SPARK_MASTER`` or ``local[2]``; pass a
    cluster URL (``spark://host:7077``, ``yarn``, ...) to run on a cluster,
    where every executor needs the qstore package installed. ``fast_start``
    trades JIT quality for start-up time (tests).
    """
    # Workers must run this interpreter, which has qstore and pyarrow installed.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    master = master or os.environ.get("QSTORE_SPARK_MASTER")
    # Under spark-submit the JVM starts this Python with a gateway port and its
    # own --master; only a plain `python` run defaults to local mode.
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = DEFAULT_MASTER
    log4j = resources.files("qstore.spark").joinpath("log4j2.properties")
    java_opts = f"-Dlog4j2.configurationFile=file:{log4j}"
    if fast_start:
        java_opts += " -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    # A local driver JVM starts before the builder's settings are read, so its own
    # options (quiet logging) must reach spark-submit; a user's setting wins.
    os.environ.setdefault("PYSPARK_SUBMIT_ARGS",
                          f'--driver-java-options "{java_opts}" pyspark-shell')
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", java_opts)
        .config("spark.executor.extraJavaOptions", java_opts)
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.python.worker.reuse", "true")
    )
    if master is not None:
        builder = builder.master(master)
    for key, value in (extra or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def register(spark: Any) -> Any:
    """Register the ``qstore`` data source on any SparkSession; returns the session."""
    from ._datasource import QStoreDataSource

    spark.dataSource.register(QStoreDataSource)
    return spark
