"""`python -m keras_mha`: the `keras-mha` command line."""

import sys

from keras_mha.cli import main

if __name__ == "__main__":
    sys.exit(main())
