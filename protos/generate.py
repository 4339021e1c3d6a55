"""``python -m protos.generate``: regenerate the stubs of every ``protos/*.proto`` (see _codegen)."""
import sys

from protos._codegen import PROTOS, PROTO_DIR, REPO_ROOT, generate

if __name__ == "__main__":
    generate()
    print("generated stubs for", ", ".join(str((PROTO_DIR / f"{n}.proto").relative_to(REPO_ROOT))
                                           for n in PROTOS), file=sys.stderr)
