"""The self-signed certificate's renewal settings: the webhook gets them, and a renewal window
as long as the certificate's life (every check would renew) is refused at render time."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.helm.chart import CHART, find, render, run, tool, with_image


def _env(objects, name: str) -> dict:
    [webhook] = [d for d in find(objects, "Deployment") if d["metadata"]["name"] == name]
    return {e["name"]: e.get("value") for e in webhook["spec"]["template"]["spec"]
            ["containers"][0]["env"]}


def test_the_webhook_renews_the_self_signed_certificate_with_the_charts_settings() -> None:
    env = _env(render({"certificates": {"selfSigned": {"certValidityDays": 90,
                                                       "renewBeforeDays": 20}}}),
               "xmem-xmem-admission-webhook")
    assert env["XMEM_CERT_SECRET"] == "xmem-xmem-admission-webhook-tls"
    assert env["XMEM_CA_SECRET"] == "xmem-xmem-admission-webhook-tls-ca"
    assert env["XMEM_WEBHOOK_CONFIGURATION"] == "xmem-xmem-admission"
    assert (env["XMEM_CERT_DAYS"], env["XMEM_RENEW_DAYS"]) == ("90", "20")
    # cert-manager renews its own: the webhook only reloads the files.
    env = _env(render({"certificates": {"mode": "certManager"}}), "xmem-xmem-admission-webhook")
    assert "XMEM_CERT_SECRET" not in env


def test_a_renewal_window_as_long_as_the_certificate_is_refused(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(with_image(
        {"certificates": {"selfSigned": {"certValidityDays": 30, "renewBeforeDays": 30}}})))
    result = run([tool("helm"), "template", "xmem", str(CHART), "--values", str(values)],
                 check=False)
    assert result.returncode != 0
    assert "renewBeforeDays must be shorter than certValidityDays" in result.stderr
