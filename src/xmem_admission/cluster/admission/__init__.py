"""The admission webhook: AdmissionReview in, AdmissionReview out, on the API server's path."""
