"""moto's S3 server, as ``moto_server`` runs it, for the tests and the bench (``tests.services.S3Server``).

One change, for speed only: moto answers each request after listing its own package folder
(``moto.backends.list_of_moto_modules``: a listdir and ~180 stats, twice a request; ~0.8 ms of the
~3.3 ms a small GET took here). The folder does not change while the server runs, so it is listed
once. Every answer is moto's own. A moto release without that function stops this server at its
start, so the S3 tests fail at once rather than run on something else.

    python -I tests/moto_s3.py -H 127.0.0.1 -p PORT   # moto_server's arguments; -I: tests/ stays off sys.path
"""

from __future__ import annotations

import moto.backends
from moto.server import main

if __name__ == "__main__":
    modules = tuple(moto.backends.list_of_moto_modules())
    moto.backends.list_of_moto_modules = lambda: modules
    main()
