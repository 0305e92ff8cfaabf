"""spark-submit entry point of the Spark audit: the ``qstore audit`` command.

    spark-submit --master spark://host:7077 spark/audit.py /shared/snap [--out DIR]

The options, output and exit codes are those of ``qstore audit`` (qstore.cli);
the session and master come from spark-submit (its --master and --conf
settings). Every executor needs `pip install "qstore[spark]"` and the
snapshot at the same path. See docs/spark.md.
"""

from qstore.cli import audit

if __name__ == "__main__":
    audit(prog_name="spark-submit spark/audit.py")
