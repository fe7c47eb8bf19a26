"""``python -m ftlaunch.lighthouse``: same as the ``ftlaunch-lighthouse`` console script."""

from ftlaunch.lighthouse.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
