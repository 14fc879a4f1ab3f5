"""Entry point: ``python -m kdelay_bench`` (run by ``tools/bench``)."""

from kdelay_bench.runner import main

raise SystemExit(main())
