"""A module whose import starts a thread (as tokenizers' or OpenMP's pools do): a zygote that preloads it
must refuse to fork (tests/core/test_warm.py)."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="started-by-an-import").start()
