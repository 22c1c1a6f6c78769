"""Attribute patches a framework integration makes in the framework's modules, and their undoing.

A record is (owner, name, original, had): `had` is True when `owner` held `name` itself (restore
it), False when it did not (delete it again), or "item:LABEL" for a mapping entry (restore the
entry). Records are undone newest first, so a name patched twice ends as it began."""


def patch(records: list, owner, name: str, value):
    records.append((owner, name, getattr(owner, name, None), name in vars(owner)))
    setattr(owner, name, value)


def patch_item(records: list, mapping, key, value, label: str):
    records.append((mapping, key, mapping[key], "item:" + label))
    mapping[key] = value


def restore(records: list):
    """Undoes every record (newest first) and empties the list."""
    while records:
        owner, name, original, had = records.pop()
        if isinstance(had, str) and had.startswith("item:"):
            owner[name] = original
        elif had:
            setattr(owner, name, original)
        else:
            try:
                delattr(owner, name)
            except AttributeError:
                pass
