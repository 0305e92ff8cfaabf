"""Building a SparkSession for qstore's jobs: local mode by default, any master by name."""

from __future__ import annotations

import os
import sys
from importlib import resources
from typing import Any

DEFAULT_MASTER = "local[2]"


def is_local(master: str | None) -> bool:
    """Whether ``master`` runs everything in the driver JVM (``local``, ``local[4]``...)."""
    return master is not None and (master == "local" or master.startswith("local["))


def get_session(master: str | None = None, app_name: str = "qstore", *,
                fast_start: bool = False, extra: dict[str, str] | None = None) -> Any:
    """A SparkSession with the ``qstore`` data source registered.

    ``master`` defaults to ``$QSTORE_SPARK_MASTER`` or ``local[2]`` (under
    spark-submit: spark-submit's); pass a cluster URL (``spark://host:7077``,
    ``yarn``, ``k8s://...``) to run on a cluster, where every executor needs
    the qstore package installed (docs/spark.md, "On a cluster").

    Only in local mode does this choose for Spark: the loopback address and
    this interpreter for the Python workers (they run on this machine). On a
    cluster, nothing of the driver's machine is handed to executors: they run
    the Python the cluster is configured with (``spark.pyspark.python`` in
    ``extra`` or ``spark-defaults.conf``, or ``PYSPARK_PYTHON`` in the
    workers' ``spark-env.sh``), with their own log configuration. The quiet
    log configuration and ``fast_start`` (JIT options that shorten start-up,
    for tests) apply to the driver, which always runs here.
    """
    from pyspark.sql import SparkSession

    master = master or os.environ.get("QSTORE_SPARK_MASTER")
    # Under spark-submit the JVM starts this Python with a gateway port and its
    # own --master; only a plain `python` run defaults to local mode.
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = DEFAULT_MASTER
    if is_local(master):
        # Workers must run this interpreter (it has qstore and pyarrow), and a local
        # run needs no network but loopback. A user's setting wins.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    log4j = resources.files("qstore.spark").joinpath("log4j2.properties")
    java_opts = f"-Dlog4j2.configurationFile=file:{log4j}"
    if fast_start:
        java_opts += " -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    # The driver JVM starts before the builder's settings are read, so its own
    # options (quiet logging) must reach spark-submit; a user's setting wins.
    # Executors get none of them: the path exists on this machine only.
    os.environ.setdefault("PYSPARK_SUBMIT_ARGS",
                          f'--driver-java-options "{java_opts}" pyspark-shell')
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
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
