"""The compactions a batch of labels names: which exist, which were judged, and at what coverage."""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import BigInteger, any_, bindparam, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from models import Compaction
from worker.core.calibration import ObservationIn


def same_coverage(sent: float, measured: float) -> bool:
    # Up to a float's round trip through another language's JSON (a last digit), no further.
    return math.isclose(sent, measured, rel_tol=1e-12, abs_tol=1e-15)


def judged_compactions(
    session: Session, observations: Sequence[ObservationIn]
) -> tuple[set[int], set[int], dict[int, float]]:
    """(the labelled compaction ids that name no compaction, those that name one never judged: failed
    before a coverage was measured, so a label of it is no calibration point, and the coverage each
    judged one was measured at). The ones found are locked FOR KEY SHARE (as the foreign key check
    itself does): none can be deleted before this transaction commits."""
    ids = {obs.compaction_id for obs in observations if obs.compaction_id is not None}
    if not ids:
        return set(), set(), {}
    # One array parameter: an IN list of 65,536 ids or more is past the protocol's bind limit.
    found = dict(
        session.execute(
            select(Compaction.id, Compaction.coverage)
            .where(Compaction.id == any_(bindparam("ids", sorted(ids), type_=ARRAY(BigInteger))))
            .with_for_update(read=True, key_share=True)
        ).all()
    )
    unjudged = {id_ for id_, coverage in found.items() if coverage is None}
    measured = {id_: float(coverage) for id_, coverage in found.items() if coverage is not None}
    return ids - set(found), unjudged, measured
