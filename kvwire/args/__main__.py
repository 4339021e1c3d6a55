"""``python -m kvwire.args --markdown > docs/configuration.md``."""
import sys

from kvwire.args.doc import markdown


def main() -> None:
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m kvwire.args --markdown > docs/configuration.md")
    sys.stdout.write(markdown())


if __name__ == "__main__":
    main()
