// Turnstile dashboard: the only script. Refreshes elements marked data-refresh by fetching
// their server-rendered fragment every few seconds (no full reload); stops when signed out.
"use strict";
(function () {
  function refresh(el) {
    var url = el.getAttribute("data-refresh");
    var seconds = Number(el.getAttribute("data-refresh-seconds")) || 5;
    var status = document.getElementById("refresh-status");
    function tick() {
      if (document.hidden) { setTimeout(tick, seconds * 1000); return; }
      fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (response) {
          if (response.status === 401) {
            if (status) { status.textContent = "signed out: reload to sign in"; }
            return null;
          }
          if (!response.ok) { throw new Error("HTTP " + response.status); }
          return response.text().then(function (html) {
            el.innerHTML = html;
            if (status) { status.textContent = "live"; }
            setTimeout(tick, seconds * 1000);
          });
        })
        .catch(function (error) {
          if (status) { status.textContent = "refresh failed (" + error.message + "), retrying"; }
          setTimeout(tick, seconds * 1000);
        });
    }
    setTimeout(tick, seconds * 1000);
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(refresh);
  });
})();
