"""The compose run keeps its fragment blobs in the object store (docker/compose-test.sh).

Runs inside a compose container whose environment has the S3 client variables (the test pipes
it into `python -` after sourcing /blobs-secrets/s3.env) and prints one JSON line:

- the run's recorded blob location is the expected s3:// URL;
- every published fragment's head value in Redis is a pointer, a few hundred bytes, not a blob;
- the object it points at exists in the store and matches the pointer's length and CRC-32;
- the store lists the run's value and momentum objects under the location.

Usage: python - EXPECTED_LOCATION < docker/check-blobs.py  (DDILOCO_REDIS_URL, DDILOCO_RUN_ID)
"""

from __future__ import annotations

import json
import os
import sys
import time

from ddiloco.store.connect import connect
from ddiloco.store.objects import MissingObject, ObjectBlobs, Pointer
from ddiloco.store.redis_store import RedisStore
from ddiloco.workers.run.manifest import manifest_layout


def main(expected: str) -> int:
    store = RedisStore(connect(os.environ["DDILOCO_REDIS_URL"]), os.environ["DDILOCO_RUN_ID"])
    location = store.blob_location
    assert location == expected, f"the run keeps its blobs in {location!r}, not {expected!r}"
    manifest = store.get_manifest()
    assert manifest is not None, "no manifest"
    n = manifest_layout(manifest).n_fragments
    objects = ObjectBlobs(location)
    checked, pointer_bytes, blob_bytes = 0, 0, 0
    for p in range(n):
        for attempt in range(5):  # a merge may collect the version under the reader: again
            head = store.heads(n)[p]
            if head is None:
                break
            raw = store.client.get(store.keys.value(p, head.version))
            if raw is None:
                time.sleep(0.5)
                continue
            ptr = Pointer.decode(raw)
            assert ptr is not None, f"fragment {p} v{head.version}: a blob in Redis, no pointer"
            assert len(raw) < 1024, f"fragment {p}: a {len(raw)}-byte pointer"
            try:
                data = objects.get(ptr)  # checks length and CRC-32
            except MissingObject:
                if attempt == 4:
                    raise
                time.sleep(0.5)
                continue
            checked += 1
            pointer_bytes += len(raw)
            blob_bytes += len(data)
            break
    assert checked > 0, "no published fragment"
    listed = objects.list(store.run_id)
    kinds = {k: sum(path.endswith(k) for path in listed) for k in (".value", ".momentum")}
    assert kinds[".value"] >= checked, f"{kinds} objects listed for {checked} heads"
    print(json.dumps({"blobs": location, "fragments": n, "heads_checked": checked,
                      "pointer_bytes": pointer_bytes, "blob_bytes": blob_bytes,
                      "objects": len(listed), **{k.lstrip("."): v for k, v in kinds.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
