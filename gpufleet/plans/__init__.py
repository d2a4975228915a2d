"""One pure plan per area: facts and settings in as arguments, a frozen, typed plan out. The
deploy applies it; the gate, the plan view and the report read it. No I/O, no pyinfra state."""
