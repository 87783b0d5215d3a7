"""Serve the vlmod web demo: `python demo/server.py [--model DIR] [--dense DIR] [--port 8000]`.

A thin wrapper around `vlmod demo` (vlmod.cli), which loads the model and runs vlmod.demo's
Starlette app under uvicorn.
"""

import sys

from vlmod.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
