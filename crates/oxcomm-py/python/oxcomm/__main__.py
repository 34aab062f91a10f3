"""``python -m oxcomm``: the ``oxcomm`` command (launch, bench, check); see :mod:`oxcomm._cli`."""

from ._cli import main

if __name__ == "__main__":
    main()
