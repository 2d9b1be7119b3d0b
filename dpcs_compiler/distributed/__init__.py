"""What ranks of one job share: agreement on profiles, plans and decisions (`rank_agreement.py`), the
runtime's signals combined over the ranks (`signals.py`), and the El Che cadence of ranks of unequal speed
(`cadence.py`).
"""

from dpcs_compiler.distributed.cadence import Cadence, CadenceConfig, CadenceError

__all__ = ["Cadence", "CadenceConfig", "CadenceError"]
