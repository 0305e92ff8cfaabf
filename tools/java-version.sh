#!/usr/bin/env bash
# Exit 0 and print the version if a Java 17+ runtime is on PATH (or in JAVA_HOME).
set -u
java_bin=java
[ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ] && java_bin="$JAVA_HOME/bin/java"
command -v "$java_bin" >/dev/null 2>&1 || { echo "no java found" >&2; exit 1; }
line=$("$java_bin" -version 2>&1 | head -n 1)
ver=$(echo "$line" | sed -E 's/.*version "([0-9]+)(\.[0-9]+)*.*/\1/')
case "$ver" in (*[!0-9]*|"") echo "cannot parse: $line" >&2; exit 1;; esac
if [ "$ver" -lt 17 ]; then echo "Java $ver found; Spark needs 17+" >&2; exit 1; fi
echo "java $ver OK"
