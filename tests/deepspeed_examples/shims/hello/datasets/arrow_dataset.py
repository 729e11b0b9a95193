"""`datasets.arrow_dataset.Dataset`, as far as HelloDeepSpeed uses it: a list of records."""


class Dataset:
    def __init__(self, records):
        self._records = list(records)

    def filter(self, fn):
        return Dataset(r for r in self._records if fn(r))

    def map(self, fn):
        return Dataset({**r, **fn(r)} for r in self._records)

    def __len__(self):
        return len(self._records)

    def __getitem__(self, i):
        return self._records[i]
