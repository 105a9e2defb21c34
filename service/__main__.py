import sys

from . import main

# guarded: the JSON decoder process (multiprocessing "spawn") imports this module again
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
