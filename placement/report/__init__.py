"""Reports of a placed model: pictures (:mod:`placement.report.draw`) and the HTML page
(:mod:`placement.report.html`)."""
