import os, sys
def make_cache(keep):
    for i in range(len(keep)):
        keep[i] = bytearray(10000)
keep = [None] * 400
if len(sys.argv) > 1:
    sys.stdin.read(1)
make_cache(keep)
os._exit(0)
