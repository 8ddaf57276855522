"""The benchmark suite: specjax methods and transformers peers on HumanEval.

The same flags as ``specjax bench`` (see ``--help`` and benchmarks/README.md), e.g.

    python benchmarks/run_suite.py --methods ar,tree --draft DRAFT --temperatures 0,1 \
        --limit 8 --max-new-tokens 128 --peers all --json benchmarks/results/suite_cpu.json \
        --plot benchmarks/results/suite_cpu
"""

import sys

from specjax import cli

if __name__ == "__main__":
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
