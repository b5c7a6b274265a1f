"""The repairs of a merged model: the registry (`registry/`: one module per repair, FeatCal
among them; what `featcal run`, `compare` and `select` dispatch through) and the baselines'
algorithms beside FeatCal, on the same merged checkpoints and calibration sets.

    regmean.py         `regmean_checkpoint`: RegMean (Jin et al., ICLR 2023) over the block Linears
    grams.py           the experts' own forward passes and their Linear input Grams
    closed_form.py     RegMean's closed form (pure float64 tensors)
    surgery.py         `train_surgery`: Representation Surgery (Yang et al., ICML 2024), one small
                       module per task on the feature its head reads
    surgery_module.py  `SurgeryModule`, `load_surgery`, `SurgeryHead` (the module before a head)
    adamerging.py      `adamerge_checkpoint`: layer-wise AdaMerging (Yang et al., ICLR 2024), the
                       merge coefficients learnt by entropy minimisation on unlabeled inputs
    trained_inputs.py  what Surgery and AdaMerging read (heads, calibration rows), checked once

`regmean_checkpoint`, `train_surgery` and `adamerge_checkpoint` load on first use, so importing this package stays light.
"""

from __future__ import annotations

__all__ = ["DEFAULT_ALPHA", "REGMEAN_RECORD", "regmean_checkpoint"]

from featcal_core.repair.defaults import REGMEAN_ALPHA as DEFAULT_ALPHA  # noqa: E402

#: Representation Surgery's names, and the module each loads from
_SURGERY = {
    "SURGERY_RECORD": "surgery",
    "train_surgery": "surgery",
    "SurgeryHead": "surgery_module",
    "SurgeryModule": "surgery_module",
    "load_surgery": "surgery_module",
    "ADAMERGING_RECORD": "adamerging",
    "adamerge_checkpoint": "adamerging",
}
__all__ += list(_SURGERY)


def __getattr__(name: str):
    if name in _SURGERY:
        import importlib

        return getattr(importlib.import_module(f"featcal_core.repair.{_SURGERY[name]}"), name)
    if name in __all__:
        from featcal_core.repair import regmean

        return getattr(regmean, name)
    raise AttributeError(f"module 'featcal_core.repair' has no attribute {name!r}")
