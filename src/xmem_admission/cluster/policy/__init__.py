"""What the admin decided and what was recorded: the policy model and where it comes from
(``model``, ``sources``), workload fingerprints (``fingerprint``), recorded estimates looked up by
fingerprint (``store``), and the one computation from an estimate to a request (``sizing``).
"""
