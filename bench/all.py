"""Run every benchmark in turn (`make bench`, or `make bench-quick` for --quick), each in its own process."""
import subprocess
import sys

BENCHMARKS = ["retrieval", "decode", "resume", "ingest", "quality", "crash"]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    failed = []
    for name in BENCHMARKS:
        print(f"== bench.{name} {' '.join(args)}", flush=True)
        if subprocess.run([sys.executable, "-m", f"bench.{name}", *args]).returncode:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
