# The Python part of the demo workload (examples/demo.c starts it as a child: `python3 demo.py`).
# It loads a product catalog and keeps it, renders pages it throws away, and exits without tearing
# the interpreter down (os._exit), so what it kept is still live at its end. Debian's python3
# serves requests of more than 512 bytes from malloc, and a bytearray(N) is one malloc of N + 1
# bytes: load_catalog keeps 64 blocks of 8,193 bytes (524,352 bytes), all allocated on its
# line 19, called from load_service (line 31), called from the module (line 37); render_pages
# allocates and drops 200 blocks of 20,001 bytes. Nothing is printed.
import os
import time

CATALOG_ITEMS = 64
ITEM_BYTES = 8192
PAGES = 200
PAGE_BYTES = 20000


def load_catalog(catalog):
    for i in range(len(catalog)):
        catalog[i] = bytearray(ITEM_BYTES)


def render_pages(catalog):
    rendered = 0
    for i in range(PAGES):
        page = bytearray(PAGE_BYTES)
        rendered += len(page) + len(catalog[i % len(catalog)])
    return rendered


def load_service(catalog):
    load_catalog(catalog)
    time.sleep(0.5)
    return render_pages(catalog)


catalog = [None] * CATALOG_ITEMS
load_service(catalog)
os._exit(0)
