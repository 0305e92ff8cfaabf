"""spark-submit entry point of the backfill job: the ``qstore backfill`` command.

    spark-submit --master spark://host:7077 spark/backfill.py SOURCE... --queue NAME \
        --payload-col body --into /shared/store [--format parquet|json|csv] ...

The options, output and exit codes are those of ``qstore backfill``
(qstore.cli); the job itself is qstore.spark.backfill.run_backfill. Every
executor needs the qstore package installed and the store directory on a
filesystem it shares with the driver. See docs/backfill.md.
"""

from qstore.cli import backfill

if __name__ == "__main__":
    backfill(prog_name="spark-submit spark/backfill.py")
