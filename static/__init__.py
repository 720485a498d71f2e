"""Static assets the web app serves at /static/lp/ (the meter script, stylesheets); no CDN."""
